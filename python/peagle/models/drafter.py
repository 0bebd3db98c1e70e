"""The P-EAGLE / EAGLE-3 drafter (SPEC.md §2) and its released checkpoint format.

Module and parameter names are the checkpoint's tensor names (SPEC §2.4): ``embed_tokens``,
``fc``, ``midlayer`` (layer 0, attention input 2H), ``layers.{1..L-1}``, ``norm``, ``lm_head``,
``d2t``, ``mask_hidden`` (P-EAGLE only) and ``t2d`` (kept if present, unused), so
``state_dict()`` *is* the ``model.safetensors`` content. Attention runs over the drafter's own paged
KV cache with ``peagle.write_kv_cache`` / ``peagle.paged_attention``. Speculators-format checkpoints
name layer 0 ``layers.0`` (:func:`speculators_to_peagle_names`); Qwen3-architecture layers add
``self_attn.q_norm`` / ``self_attn.k_norm``; layers may attend over a sliding window.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from peagle.models.drafter_config import DrafterConfig
from peagle.models.fused import FusedLayer, fuse_layer, rms_norm, weights_key
from peagle.models.paged import (
    AttentionMetadata,
    PagedKVCache,
    paged_attention_forward,
    rope_cos_sin,
)

# attend(layer_index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"


class DrafterAttention(nn.Module):
    """q/k/v/o projections (q/k/v from ``input_size``: 2H in layer 0, H after) + paged attention."""

    def __init__(self, cfg: DrafterConfig, input_size: int) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scaling = cfg.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        if cfg.qk_norm:  # Qwen3: per-head RMSNorm of q and k before RoPE
            self.q_norm = LlamaRMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend, layer_index: int,
        fused: FusedLayer | None = None,
    ) -> torch.Tensor:  # fmt: skip
        t = x.shape[0]
        if fused is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = fused.project_qkv(self, x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        o = attend(layer_index, q, k, v)
        return self.o_proj(o.reshape(t, -1))


def paged_attend(
    meta: AttentionMetadata,
    kv: PagedKVCache,
    softmax_scale: float,
    windows: list[int | None] | None = None,
) -> AttendFn:
    """The decode path's attention: each layer writes its K/V rows into its layer of the paged
    cache ``kv`` and attends causally over it (``meta``: slots and the ragged layout); layer ``i``
    with a sliding window ``windows[i]`` sees keys at positions ``> p - window`` from a row at
    position ``p`` (``window_left = window - 1``)."""

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        w = windows[i] if windows is not None else None
        return paged_attention_forward(
            q.contiguous(), k.contiguous(), v.contiguous(), kv.layer(i), meta,
            softmax_scale=softmax_scale, window_left=-1 if w is None else w - 1,
        )  # fmt: skip

    return attend


class DrafterLayer(nn.Module):
    """A pre-norm Llama decoder layer; the first one (``midlayer``) also has ``hidden_norm`` and
    attends over ``cat(input_layernorm(embed), hidden_norm(h))`` (SPEC §2.2)."""

    def __init__(self, cfg: DrafterConfig, first: bool) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.first = first
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        if first:
            self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.self_attn = DrafterAttention(cfg, 2 * h if first else h)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)
        self.mlp = LlamaMLP(cfg.llama_config())

    def forward(
        self, embeds, x, residual, cos, sin, attend: AttendFn, layer_index: int,
        fused: DrafterLayerPlan | None = None,
    ):  # fmt: skip
        f = None if fused is None else fused.layer
        input_norm = self.input_layernorm if f is None else f.input_norm
        if self.first:
            hidden_norm = self.hidden_norm if fused is None else fused.hidden_norm
            e = input_norm(embeds)
            if self.norm_before_residual:
                x = hidden_norm(x)
                residual = x
            else:
                residual = x
                x = hidden_norm(x)
            x = torch.cat([e, x], dim=-1)
        else:
            residual = residual + x
            x = input_norm(residual)
        x = self.self_attn(x, cos, sin, attend, layer_index, f)
        residual = residual + x
        if f is None:
            return self.mlp(self.post_attention_layernorm(residual)), residual
        return f.mlp(self, f.post_norm(residual), _module_mlp), residual


def _module_mlp(layer: DrafterLayer, x: torch.Tensor) -> torch.Tensor:
    return layer.mlp(x)


class DrafterLayerPlan:
    """A drafter layer's fused inference pieces (:mod:`peagle.models.fused`): the shared
    :class:`FusedLayer` (norms, q/k/v and gate/up GEMMs) plus layer 0's ``hidden_norm``."""

    def __init__(self, layer: DrafterLayer) -> None:
        self.layer = fuse_layer(layer)
        self.hidden_norm = rms_norm(layer.hidden_norm) if layer.first else None


class Eagle3Drafter(nn.Module):
    """EAGLE-3 layout drafter; with ``mask_hidden`` (and a mask token id) it drafts in parallel.

    Args:
        cfg: the checkpoint's :class:`DrafterConfig`.
        with_mask_hidden: create the ``mask_hidden`` ``[1, 1, 3*H_t]`` parameter (P-EAGLE).
        with_t2d: create the (unused) ``t2d`` ``[V]`` bool buffer so it round-trips.
    """

    def __init__(self, cfg: DrafterConfig, with_mask_hidden: bool = True, with_t2d: bool = False):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        feat = 3 * cfg.target_hidden_size if cfg.use_aux_hidden_state else h
        if cfg.use_aux_hidden_state:
            self.fc = nn.Linear(feat, h, bias=False)
        self.midlayer = DrafterLayer(cfg, first=True)
        self.layers = nn.ModuleDict(
            {str(i): DrafterLayer(cfg, first=False) for i in range(1, cfg.num_hidden_layers)}
        )
        self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, feat)) if with_mask_hidden else None
        if with_t2d:
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        else:
            self.t2d = None
        self._rotary: dict[torch.device, nn.Module] = {}
        # Inference (no grad) runs the fused layer paths; training keeps the modules' forwards.
        self.fused_layers = os.environ.get("PEAGLE_FUSED_DRAFTER", "1") != "0"
        self._fused: list[DrafterLayerPlan] | None = None
        self._fused_for: tuple | None = None

    # -- properties -----------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def supports_parallel_drafting(self) -> bool:
        return self.mask_hidden is not None and self.config.mask_token_id is not None

    def decoder_layers(self) -> list[DrafterLayer]:
        return [self.midlayer, *self.layers.values()]

    # -- compatibility checks -------------------------------------------------------------------

    def check_target(self, target_hidden_size: int, target_vocab_size: int) -> None:
        """Raise ``ValueError`` if this drafter cannot serve a target of these sizes."""
        cfg = self.config
        if cfg.target_hidden_size != target_hidden_size:
            raise ValueError(
                f"hidden-size mismatch: the drafter expects target hidden size "
                f"{cfg.target_hidden_size} (config target_hidden_size/hidden_size), the target "
                f"model has {target_hidden_size}"
            )
        if cfg.vocab_size != target_vocab_size:
            raise ValueError(
                f"vocabulary mismatch: the drafter's vocab_size is {cfg.vocab_size}, the target's "
                f"lm_head has {target_vocab_size} rows"
            )
        if self.d2t.device.type == "meta":  # shapes only (a checkpoint checked on meta)
            return
        targets = torch.arange(cfg.draft_vocab_size, device=self.d2t.device) + self.d2t
        if cfg.draft_vocab_size and (targets.min() < 0 or targets.max() >= target_vocab_size):
            raise ValueError(
                f"d2t maps draft ids to target ids in "
                f"[{int(targets.min())}, {int(targets.max())}], "
                f"outside the target vocabulary [0, {target_vocab_size})"
            )

    def check_parallel_drafting(self) -> None:
        """Raise ``ValueError`` unless the checkpoint can draft in parallel (P-EAGLE)."""
        cfg = self.config
        if self.mask_hidden is None:
            raise ValueError(
                "parallel drafting (method 'peagle') needs a P-EAGLE checkpoint with a "
                "'mask_hidden' tensor; this drafter has none (an autoregressive EAGLE-3 head: use "
                "method 'eagle3')"
            )
        if cfg.mask_token_id is None:
            raise ValueError(
                "parallel drafting needs the mask token id: config.json has neither "
                "'ptd_token_id' nor 'pard_token'"
            )
        if not 0 <= cfg.mask_token_id < cfg.vocab_size:
            raise ValueError(
                f"mask token id {cfg.mask_token_id} is outside the vocabulary [0, {cfg.vocab_size})"
            )
        if cfg.use_aux_hidden_state and cfg.hidden_size != cfg.target_hidden_size:
            raise ValueError(
                f"parallel drafting needs hidden_size == target_hidden_size (vLLM sizes "
                f"mask_hidden as 3*hidden_size), got {cfg.hidden_size} != {cfg.target_hidden_size}"
            )

    # -- forward --------------------------------------------------------------------------------

    def rotary(self) -> nn.Module:
        """The rotary module for the weights' device, kept outside ``state_dict``/``.to(dtype)``
        so its inverse frequencies stay in float32."""
        dev = self.device
        if dev not in self._rotary:
            self._rotary[dev] = LlamaRotaryEmbedding(self.config.llama_config()).to(dev)
        return self._rotary[dev]

    def fused_plan(self) -> list[DrafterLayerPlan] | None:
        """Per decoder layer, its fused inference pieces; None while gradients are enabled
        (training differentiates through the modules' own parameters) or with
        ``PEAGLE_FUSED_DRAFTER=0``. Fusing makes the q/k/v and gate/up weights views of one
        tensor each (same values, no extra memory); rebuilt after ``.to()`` moves them."""
        if not self.fused_layers or torch.is_grad_enabled():
            return None
        layers = self.decoder_layers()
        if self._fused is None or self._fused_for != weights_key(layers):
            self._fused = [DrafterLayerPlan(la) for la in layers]
            self._final_norm = rms_norm(self.norm)
            self._fused_for = weights_key(layers)  # of the rebound (concatenated) weights
        return self._fused

    def project_target_hidden(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """``fc`` over the concatenated target features ``[T, 3*H_t] -> [T, H]`` (identity when
        ``use_aux_hidden_state`` is false)."""
        return self.fc(aux_hidden) if self.config.use_aux_hidden_state else aux_hidden

    def mask_vector(self) -> torch.Tensor:
        """``fc(mask_hidden.view(3*H_t))`` ``[H]``, the hidden input of every mask row (SPEC §4).
        Compute it once per engine (and again after ``fc`` or ``mask_hidden`` change)."""
        self.check_parallel_drafting()
        with torch.no_grad():
            return self.project_target_hidden(self.mask_hidden.reshape(1, -1)).reshape(-1)

    def make_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        cfg = self.config
        return PagedKVCache(
            cfg.num_hidden_layers,
            num_blocks,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            self.dtype,
            self.device,
        )

    def kv_bytes_per_token(self) -> int:
        cfg = self.config
        return (
            2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * self.dtype.itemsize
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        meta: AttentionMetadata | None = None,
        kv: PagedKVCache | None = None,
        *,
        positions: torch.Tensor | None = None,
        attend: AttendFn | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafter forward over ``T`` rows (SPEC §2.2): over the paged cache (``meta``, ``kv``), or
        under any attention rule (``positions``, ``attend``: the training mask, SPEC §8.3).

        Args:
            input_ids: ``[T]`` token ids (mask rows carry the mask id).
            hidden_states: ``[T, H]`` already projected features (``fc`` output, the mask vector,
                or the previous pass's pre-norm output for serial EAGLE-3 passes).
            meta: positions / slots / attention layout over the drafter's own cache.
            kv: the drafter's cache.
            positions: ``[T]`` int64 RoPE positions (with ``attend``, instead of ``meta``).
            attend: attention of one layer given post-RoPE q/k/v of these rows (instead of the
                paged cache: :func:`paged_attend`).

        Returns:
            ``(normed, prenorm)`` ``[T, H]``: sample from ``normed`` (:meth:`compute_logits`);
            ``prenorm`` feeds the next serial pass.
        """
        if attend is None:
            attend = paged_attend(meta, kv, self.config.head_dim**-0.5, self.config.layer_windows())
            positions = meta.positions
        embeds = self.embed_tokens(input_ids.long())
        cos, sin = rope_cos_sin(self.rotary(), embeds, positions)
        x, residual = hidden_states, None
        plan = self.fused_plan()
        for i, layer in enumerate(self.decoder_layers()):
            x, residual = layer(
                embeds, x, residual, cos, sin, attend, i, None if plan is None else plan[i]
            )
        prenorm = residual + x
        return (self.norm if plan is None else self._final_norm)(prenorm), prenorm

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[R, V_d]`` (times ``logit_scale``)."""
        logits = self.lm_head(normed)
        if self.config.logit_scale != 1.0:
            logits = logits * self.config.logit_scale
        return logits

    def greedy_draft(self, normed: torch.Tensor) -> torch.Tensor:
        """Argmax drafts as *target* ids ``[R]`` int32 (``draft_id + d2t[draft_id]``)."""
        idx = self.compute_logits(normed).argmax(dim=-1)
        return (idx + self.d2t[idx]).to(torch.int32)

    # -- checkpoint I/O -------------------------------------------------------------------------

    def save_pretrained(
        self,
        path: str | Path,
        *,
        format: str = "eagle3",
        speculative_tokens: int | None = None,
        verifier_name_or_path: str | None = None,
        verifier_architectures: list[str] | None = None,
    ) -> None:
        """Write ``config.json`` and ``model.safetensors``.

        Args:
            format: ``"eagle3"``: ``architectures: ["LlamaForCausalLMEagle3"]`` and the tensor
                names of SPEC §2.4 (vLLM's EAGLE-3 path). ``"speculators"``: the speculators 0.9
                format (:meth:`DrafterConfig.to_speculators_dict`; ``"peagle"`` when the drafter
                can draft in parallel, else ``"eagle3"``; layer 0 as ``layers.0``; ``d2t``/``t2d``
                only with a reduced draft vocabulary, ``t2d`` rebuilt from ``d2t``).
            speculative_tokens: the speculators config's proposal length (default: 5).
            verifier_name_or_path / verifier_architectures: the target, for speculators'
                ``speculators_config.verifier``.
        """
        from safetensors.torch import save_file

        if format not in SAVE_FORMATS:
            raise ValueError(f"save format {format!r} not in {SAVE_FORMATS}")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        # Copies: fused weights are views of one tensor, which safetensors refuses to save.
        state = {
            k: v.detach().to("cpu", copy=True).contiguous() for k, v in self.state_dict().items()
        }
        if format == "speculators":
            d = self.config.to_speculators_dict(
                parallel=self.supports_parallel_drafting,
                speculative_tokens=speculative_tokens or 5,
                verifier_name_or_path=verifier_name_or_path,
                verifier_architectures=verifier_architectures,
            )
            state = peagle_to_speculators_state(state, self.config)
        else:
            d = self.config.to_dict()
        d["torch_dtype"] = str(self.dtype).removeprefix("torch.")
        with open(path / "config.json", "w") as f:
            json.dump(d, f, indent=2, sort_keys=True)
            f.write("\n")
        save_file(state, str(path / SAFETENSORS_NAME), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        shared_embed_tokens: torch.Tensor | None = None,
        shared_lm_head: torch.Tensor | None = None,
    ) -> Eagle3Drafter:
        """Load a drafter directory (``config.json`` + ``*.safetensors``).

        Args:
            dtype: parameter dtype (default: the checkpoint's floating dtype).
            device: where the weights go. ``"meta"`` reads only the safetensors *headers* (names,
                dtypes, shapes) and runs every name/shape check without reading tensor data: a
                multi-GB release can be checked cheaply (:func:`read_safetensors_header`).
            shared_embed_tokens / shared_lm_head: the target's ``[V, H]`` embedding / lm_head
                weight, used only when the checkpoint lacks ``embed_tokens.weight`` /
                ``lm_head.weight`` (some autoregressive EAGLE-3 heads share them with the
                target; P-EAGLE checkpoints carry their own embedding with the learned mask row).

        Raises:
            FileNotFoundError: no ``config.json`` or no safetensors file.
            ValueError: unknown architecture, unexpected or wrongly shaped tensors, missing
                tensors that cannot be shared (a missing ``o_proj.bias`` of a checkpoint with
                ``attention_bias`` is zero, as in vLLM).
        """
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"drafter checkpoint {path} has no config.json")
        cfg = DrafterConfig.from_json_file(path / "config.json")
        meta = torch.device(device).type == "meta"
        state = _load_safetensors(path, meta=meta)
        if cfg.source_format == "speculators":
            state = speculators_to_peagle_names(state)
        if "embed_tokens.weight" not in state and shared_embed_tokens is not None:
            state["embed_tokens.weight"] = shared_embed_tokens
        if "lm_head.weight" not in state and shared_lm_head is not None:
            if cfg.draft_vocab_size != shared_lm_head.shape[0]:
                raise ValueError(
                    f"{path}: no lm_head.weight and the target's lm_head has "
                    f"{shared_lm_head.shape[0]} rows, not draft_vocab_size={cfg.draft_vocab_size}"
                )
            state["lm_head.weight"] = shared_lm_head
        if "d2t" not in state:
            if cfg.draft_vocab_size != cfg.vocab_size:
                raise ValueError(
                    f"{path}: no d2t tensor but draft_vocab_size {cfg.draft_vocab_size} != "
                    f"vocab_size {cfg.vocab_size}"
                )
            state["d2t"] = torch.zeros(
                cfg.draft_vocab_size, dtype=torch.long, device="meta" if meta else "cpu"
            )
        with torch.device("meta"):
            model = cls(cfg, with_mask_hidden="mask_hidden" in state, with_t2d="t2d" in state)
        expected = model.state_dict()
        for k, v in expected.items():
            # Checkpoints with q/k/v biases may lack the o_proj bias; vLLM leaves it at zero.
            if k.endswith("o_proj.bias") and k not in state:
                state[k] = torch.zeros(
                    v.shape, dtype=torch.float32, device=v.device if meta else "cpu"
                )
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"{path}: checkpoint tensors do not match the config "
                f"(num_hidden_layers={cfg.num_hidden_layers}): missing {missing}, "
                f"unexpected {unexpected}"
            )
        for k, v in expected.items():
            if tuple(state[k].shape) != tuple(v.shape):
                raise ValueError(
                    f"{path}: tensor {k} has shape {tuple(state[k].shape)}, the config implies "
                    f"{tuple(v.shape)}"
                )
        if dtype is None:
            floats = [t.dtype for k, t in state.items() if t.is_floating_point()]
            dtype = floats[0] if floats else torch.float32
        for k, t in state.items():
            state[k] = t.to(dtype=dtype if t.is_floating_point() else expected[k].dtype)
        model.load_state_dict(state, assign=True)
        return model.to(device).eval()


SAVE_FORMATS = ("eagle3", "speculators")
# Tensors speculators keeps in its training model only (verifier copies; never needed to draft).
_SPECULATORS_TRAINING_ONLY = ("verifier_norm.weight", "verifier_lm_head.weight")


def speculators_to_peagle_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A speculators state dict under peagle's names: ``layers.0.*`` -> ``midlayer.*``, the
    training-only verifier tensors dropped; every other name is the same in both formats."""
    out = {}
    for k, v in state.items():
        if k in _SPECULATORS_TRAINING_ONLY:
            continue
        out["midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k] = v
    return out


def peagle_to_speculators_state(
    state: dict[str, torch.Tensor], cfg: DrafterConfig
) -> dict[str, torch.Tensor]:
    """peagle's state dict under speculators' names (inverse of
    :func:`speculators_to_peagle_names`). speculators registers ``d2t``/``t2d`` only when the draft
    vocabulary is smaller than the target's; then ``t2d`` (target ids kept) comes from ``d2t``."""
    out = {}
    for k, v in state.items():
        out["layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k] = v
    out.pop("t2d", None)
    d2t = out.pop("d2t")
    if cfg.draft_vocab_size != cfg.vocab_size:
        out["d2t"] = d2t
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + d2t] = True
        out["t2d"] = t2d
    return out


# safetensors header dtype names -> torch dtypes (the format's documented spellings).
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def read_safetensors_header(file: str | Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` from a safetensors file's header alone (the first 8 bytes give
    the JSON header's length; no tensor data is read, so a header-only file works too).

    Raises:
        ValueError: not a safetensors header, or a dtype peagle does not know.
    """
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{file}: not a safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(raw, "little")
        if n > 100 << 20:
            raise ValueError(f"{file}: not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{file}: unreadable safetensors header: {e}") from e
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{file}: tensor {name} has unsupported dtype {info['dtype']}")
        out[name] = (_ST_DTYPES[info["dtype"]], tuple(int(d) for d in info["shape"]))
    return out


def _load_safetensors(path: Path, meta: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint (``meta``: empty meta tensors from the headers)."""
    from safetensors.torch import load_file

    index = path / SAFETENSORS_INDEX_NAME
    if index.is_file():
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif (path / SAFETENSORS_NAME).is_file():
        files = [SAFETENSORS_NAME]
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"drafter checkpoint {path} has no *.safetensors file")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        if meta:
            for k, (dt, shape) in read_safetensors_header(path / name).items():
                state[k] = torch.empty(shape, dtype=dt, device="meta")
        else:
            state.update(load_file(str(path / name)))
    return state
