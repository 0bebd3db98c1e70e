"""vLLM adapter: vLLM's P-EAGLE path on ``torch.ops.peagle`` (see docs/vllm-adapter.md).

When vLLM runs ``method: "eagle3"`` with ``parallel_drafting: true`` (P-EAGLE), the adapter
replaces its draft-input preparation (Stage A next tokens, the copy-and-expand kernel, the
hidden-state scatter + mask broadcast, the slot mapping and the metadata extension) with
``peagle.ops.prepare_next_token_ids`` / ``prepare_draft_inputs`` (:mod:`peagle.vllm.proposer`)
and its chain rejection sampling with ``peagle.ops.verify_chain`` (:mod:`peagle.vllm.sampler`).

* vLLM loads it by itself: ``pip install peagle`` registers the ``vllm.general_plugins`` entry
  point ``peagle = peagle.vllm:register``, which vLLM calls in every process it starts.
  Scripts that build vLLM objects directly call :func:`enable`.
* ``PEAGLE_VLLM=1`` (default) / ``0``: on / off. Off installs nothing.
* Known vLLM: :data:`TESTED_VLLM_RANGE` (0.28 to 0.33). Another version is left alone with one
  warning (from 0.34 on vLLM has no P-EAGLE path: it removed the V1 runner and parallel drafting
  for eagle3, and the adapter does not plug into its V2 speculator API); within the range the
  hooks are chosen by feature detection (:func:`peagle.vllm._patch.hook_points`), and a release
  whose hook points differ from what the adapter knows is left alone with one warning too.
* Activation logs ``peagle: vLLM adapter active: ...`` (INFO, logger ``vllm.peagle``), once per
  replaced part. Anything the ops do not support (tree drafting, M-RoPE, heterogeneous
  vocabularies, synthetic rejection sampling, float64 exponentials, a device without peagle
  kernels, ...) keeps vLLM's own code with one warning ``peagle: vLLM P-EAGLE ... stays on
  vLLM's own code: <reason>``.

Importing this package does not import vLLM; :func:`enable` does.
"""

from __future__ import annotations

from peagle.vllm._settings import ENV_SWITCH, TESTED_VLLM_RANGE, switch_on, version_tested

__all__ = ["ENV_SWITCH", "TESTED_VLLM_RANGE", "disable", "enable", "is_enabled", "register"]


def enable() -> bool:
    """Install the adapter into vLLM (imports vLLM). Idempotent.

    Returns:
        True when the hooks are installed; False when ``PEAGLE_VLLM=0``, when vLLM is missing,
        when its version is outside :data:`TESTED_VLLM_RANGE` or when its hook points are not the
        ones the adapter knows (one warning, vLLM untouched).
    """
    from peagle.vllm import _patch
    from peagle.vllm import _settings as st

    if not switch_on():
        st.info_once("off", f"peagle: {ENV_SWITCH}=0, the vLLM adapter is off")
        return False
    try:
        import vllm
    except ImportError as e:
        st.warn_once("no-vllm", f"peagle: vLLM adapter not installed: cannot import vllm ({e})")
        return False
    version = getattr(vllm, "__version__", "unknown")
    if not version_tested(version):
        st.warn_once(f"version:{version}", st.out_of_range_message(version))
        return False
    missing = _patch.install()
    if missing:
        st.warn_once(
            f"hooks:{version}",
            f"peagle: vLLM {version}'s P-EAGLE code lacks hook points the adapter needs "
            f"({'; '.join(missing)}); vLLM's own P-EAGLE code is used",
        )
        return False
    return True


def disable() -> None:
    """Remove the adapter's hooks from vLLM (objects built while it was on keep their flags,
    which vLLM's restored code ignores)."""
    from peagle.vllm import _patch

    _patch.disable()


def is_enabled() -> bool:
    """Whether the hooks are currently installed."""
    from peagle.vllm import _patch

    return _patch.is_patched()


def register() -> None:
    """``vllm.general_plugins`` entry point: :func:`enable`, never raising into vLLM."""
    from peagle.vllm import _settings as st

    try:
        enable()
    except Exception as e:  # a broken adapter must not stop vLLM: keep its own code
        st.warn_once("register", f"peagle: vLLM adapter failed to install ({e!r}); vLLM unchanged")
        from peagle.vllm import _patch

        _patch.disable()
