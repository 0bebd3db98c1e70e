"""Target runner: a Hugging Face pre-norm decoder (dense or MoE) over peagle's paged KV cache.

The model is loaded by transformers (config + safetensors weights); the runner reuses its modules
(embedding, RMSNorms, q/k/v/o projections, Qwen3's q/k norms, the model's own RoPE function and
rotary module -- YaRN for GPT-OSS --, dense MLPs or MoE blocks with their routers, lm_head) and
replaces only attention: K/V rows go into a :class:`~peagle.models.paged.PagedKVCache` with
``peagle.write_kv_cache`` and attention runs with ``peagle.paged_attention``, with the layer's
sliding window and (GPT-OSS) learned attention sinks. One forward returns the logits of the
requested rows (the verify rows) and the EAGLE-3 auxiliary hidden states.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope

from peagle.models.fused import fuse_layer, rms_norm, weights_key
from peagle.models.paged import (
    AttentionMetadata,
    PagedKVCache,
    paged_attention_forward,
    rope_cos_sin,
)

# Decoder-only models whose layers are the pre-norm block ``x += attn(norm(x)); x += mlp(norm(x))``
# (Qwen3 adds per-head q/k RMSNorm, Qwen2 q/k/v biases, Mistral a sliding window; Qwen3-MoE a
# sparse MoE block; GPT-OSS an MoE block, alternating full / sliding-window layers, attention sinks
# and YaRN RoPE). docs/targets.md lists what was tested for each.
SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen2", "mistral", "qwen3_moe", "gpt_oss")

# transformers experts implementations that never sync with the host (CUDA-graph capturable);
# "eager" loops over the experts hit by the batch (``nonzero``), which a graph cannot capture.
_GRAPH_SAFE_EXPERTS = ("grouped_mm", "batched_mm")


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3 default feature layers ``[2, L//2, L-3]`` (SPEC.md §2.1)."""
    return [2, num_layers // 2, num_layers - 3]


def suggested_aux_layer_ids(num_layers: int) -> list[int]:
    """The ids ``peagle train`` picks (docs/training.md): ``[2, L//2, L-3]`` from 7 layers up,
    ``[1, L//2, L-1]`` below (where the EAGLE-3 default is not strictly increasing)."""
    if num_layers >= 7:
        return default_aux_layer_ids(num_layers)
    return [1, num_layers // 2, num_layers - 1]


def _check_aux_layer_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    ids = [int(i) for i in ids]
    if len(ids) != 3:
        raise ValueError(f"EAGLE-3 needs exactly 3 auxiliary layer ids, got {ids}")
    if any(i < 0 or i >= num_layers for i in ids) or sorted(set(ids)) != ids:
        raise ValueError(
            f"auxiliary layer ids {ids} must be strictly increasing layer indices in "
            f"[0, {num_layers}) (vLLM collects them in layer order), e.g. "
            f"{suggested_aux_layer_ids(num_layers)} for a target with {num_layers} layers"
        )
    return ids


def _rope_function(attn: torch.nn.Module) -> Callable:
    """The model's own ``apply_rotary_pos_emb`` (GPT-OSS rotates halves with a ``[T, D/2]``
    cos/sin, Llama-style models ``rotate_half`` with ``[T, D]``): looked up in the module that
    defines the attention class, Llama's as a fallback."""
    fn = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
    return fn if callable(fn) else llama_rope


def _mlp(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's feed-forward block on ``[T, H]`` rows. MoE blocks (router + experts) take
    ``[batch, seq, H]`` and may return ``(hidden, router_scores)``; dense MLPs take any shape."""
    y = layer.mlp(x.unsqueeze(0))
    if isinstance(y, tuple):
        y = y[0]
    return y.reshape(x.shape)


def _experts_modules(layers: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    return [e for layer in layers if (e := getattr(layer.mlp, "experts", None)) is not None]


class TargetRunner:
    """Runs a transformers ``*ForCausalLM`` (Llama 3, Qwen3 dense / MoE, GPT-OSS, ...) with a
    paged KV cache.

    Args:
        model: a loaded ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` / ``Qwen2ForCausalLM`` /
            ``MistralForCausalLM`` / ``Qwen3MoeForCausalLM`` / ``GptOssForCausalLM``.
        aux_layer_ids: the 3 target layers whose *input* residual stream feeds the drafter
            (default ``[2, L//2, L-3]``; none for targets shallower than 6 layers, whose default
            is not strictly increasing, until :meth:`set_aux_layer_ids`).

    Attributes:
        window_left: per layer, the ``paged_attention`` window (-1 = full attention).
        has_sinks: per layer, whether attention has learned sink logits (GPT-OSS).

    Raises:
        ValueError: unsupported model type, bad auxiliary layer ids.
    """

    def __init__(self, model: torch.nn.Module, aux_layer_ids: Sequence[int] | None = None) -> None:
        cfg = model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"target model_type {cfg.model_type!r} is not supported; peagle runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (pre-norm decoders, dense or MoE)"
            )
        self.model = model.eval()
        self.config = cfg
        base = model.model
        self.embed_tokens = base.embed_tokens
        self.layers = list(base.layers)
        self.norm = base.norm
        self.rotary_emb = base.rotary_emb
        self.lm_head = model.lm_head
        self.num_layers = len(self.layers)
        self.hidden_size = cfg.hidden_size
        self.vocab_size = self.lm_head.out_features
        attn0 = self.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.num_kv_heads = cfg.num_key_value_heads
        self.num_heads = cfg.num_attention_heads
        self.apply_rope = _rope_function(attn0)
        if aux_layer_ids is None:
            try:
                ids = _check_aux_layer_ids(default_aux_layer_ids(self.num_layers), self.num_layers)
            except ValueError:  # too shallow for [2, L//2, L-3]: no features until set
                ids = []
        else:
            ids = _check_aux_layer_ids(aux_layer_ids, self.num_layers)
        self.aux_layer_ids = ids
        self.window_left = [self._window_left(i) for i in range(self.num_layers)]
        self.has_sinks = [getattr(la.self_attn, "sinks", None) is not None for la in self.layers]
        self.load_plan = None  # set by from_pretrained for quantized checkpoints
        # PEAGLE_FUSED_TARGET=0: transformers' own module forwards (for A/B runs).
        self.fused_layers = os.environ.get("PEAGLE_FUSED_TARGET", "1") != "0"
        self._fused: list | None = None
        self._fused_for = None

    def _fused_plan(self) -> list:
        """Per layer, its :class:`~peagle.models.fused.FusedLayer` (rebuilt when ``.to()`` gave
        the weights new storage since: another device or dtype, and back)."""
        if self._fused is None or self._fused_for != weights_key(self.layers):
            self._fused = [fuse_layer(la) for la in self.layers]
            self._final_norm = rms_norm(self.norm)
            self._fused_for = weights_key(self.layers)  # of the rebound (concatenated) weights
        return self._fused

    def set_aux_layer_ids(self, aux_layer_ids: Sequence[int]) -> None:
        """Use these 3 layers' input residual streams as the drafter features (from the
        drafter's ``eagle_config.eagle_aux_hidden_state_layer_ids``)."""
        self.aux_layer_ids = _check_aux_layer_ids(aux_layer_ids, self.num_layers)

    def _window_left(self, i: int) -> int:
        # transformers' sliding window W (masking_utils.sliding_window_overlay, and FlashAttention
        # window_size W-1): key k is visible to query q iff q - W < k <= q, i.e. W keys including
        # the query's own; paged_attention's window_left counts the keys to the left: W - 1.
        cfg = self.config
        window = getattr(cfg, "sliding_window", None)
        if not window or getattr(cfg, "use_sliding_window", True) is False:
            return -1
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types:  # GPT-OSS (alternating), Qwen2/3 (max_window_layers)
            sliding = layer_types[i] == "sliding_attention"
        else:  # Mistral, Qwen3-MoE: every layer when the config sets a window
            sliding = True
        return int(window) - 1 if sliding else -1

    @property
    def cuda_graph_blocker(self) -> str | None:
        """Why a forward cannot be captured in a CUDA graph (None: it can). MoE experts must
        run an implementation without host syncs (transformers' ``grouped_mm``/``batched_mm``)."""
        for experts in _experts_modules(self.layers):
            if type(experts).__name__.startswith("Mxfp4"):
                return "the MXFP4 experts run triton kernels peagle has not validated in graphs"
            impl = getattr(getattr(experts, "config", self.config), "_experts_implementation", None)
            if impl not in _GRAPH_SAFE_EXPERTS:
                return (
                    f"the MoE experts run transformers' {impl or 'eager'!r} implementation, which "
                    f"syncs with the host (graph-safe: {', '.join(_GRAPH_SAFE_EXPERTS)})"
                )
        return None

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        aux_layer_ids: Sequence[int] | None = None,
        mxfp4: str | None = None,
        log: Callable[[str], None] | None = None,
    ) -> TargetRunner:
        """Load config and weights with transformers (``AutoModelForCausalLM``).

        Args:
            mxfp4: for checkpoints with MXFP4 experts (GPT-OSS): ``"auto"`` (default, or the
                ``PEAGLE_MXFP4`` environment variable) keeps MXFP4 with transformers' kernels when
                they are usable on ``device`` and dequantizes to bf16 otherwise, ``"dequantize"``,
                or ``"native"`` (fail instead of dequantizing). See :mod:`peagle.models.mxfp4`.
            log: where the memory message of a quantized checkpoint goes (default: stderr).

        Raises:
            ValueError: unsupported model type; a dequantized checkpoint larger than the device.
        """
        from transformers import AutoConfig, AutoModelForCausalLM

        from peagle.models.mxfp4 import plan_quantized_load

        cfg = AutoConfig.from_pretrained(path)
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{path}: target model_type {cfg.model_type!r} is not supported; peagle runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        device = torch.device(device)
        mode = mxfp4 or os.environ.get("PEAGLE_MXFP4", "auto")
        plan = plan_quantized_load(cfg, device=device, dtype=dtype, mode=mode, name=str(path))
        if plan is None:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto")
            runner = cls(model.to(device), aux_layer_ids)
        else:
            log = log or _stderr
            log(plan.message)
            model = plan.load(str(path), log)  # CUDA: placed on the device while loading
            runner = cls(model if device.type == "cuda" else model.to(device), aux_layer_ids)
            runner.load_plan = plan
        return runner

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def make_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        return PagedKVCache(
            self.num_layers,
            num_blocks,
            block_size,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.device,
        )

    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def _attention(
        self,
        i: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv: PagedKVCache,
        fused=None,
    ) -> torch.Tensor:
        attn = self.layers[i].self_attn
        t = x.shape[0]
        if fused is None:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        else:
            q, k, v = fused.project_qkv(attn, x)
        q = q.view(t, -1, self.head_dim)
        k = k.view(t, -1, self.head_dim)
        v = v.view(t, -1, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over head_dim before RoPE
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        q, k = self.apply_rope(q, k, cos, sin, unsqueeze_dim=1)
        # GPT-OSS: one unscaled logit per head joins the softmax denominator (fp32 for the op).
        sinks = attn.sinks.float() if self.has_sinks[i] else None
        o = paged_attention_forward(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            kv.layer(i),
            meta,
            softmax_scale=attn.scaling,
            window_left=self.window_left[i],
            sinks=sinks,
        )
        return attn.o_proj(o.reshape(t, -1))

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv: PagedKVCache,
        logits_indices: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over a ragged batch of rows.

        Args:
            input_ids: ``[T]`` token ids (int32 or int64).
            meta: positions, slot mapping and attention layout of the rows.
            kv: this model's cache (written at ``meta.slot_mapping``).
            logits_indices: ``[R]`` rows whose logits are returned (default: all rows).

        Returns:
            ``(logits [R, V], aux_hidden [T, 3*H])``: logits in the model dtype, and the residual
            streams at the input of the 3 auxiliary layers, concatenated in layer order
            (``[T, 0]`` when the runner has no auxiliary layers: a target shallower than 6
            layers whose ids were never set, used without a drafter).
        """
        x = self.embed_tokens(input_ids.long())
        cos, sin = rope_cos_sin(self.rotary_emb, x, meta.positions)
        aux = []
        plan = self._fused_plan() if self.fused_layers else None
        for i, layer in enumerate(self.layers):
            if i in self.aux_layer_ids:
                aux.append(x)
            if plan is None:
                x = x + self._attention(i, layer.input_layernorm(x), cos, sin, meta, kv)
                x = x + _mlp(layer, layer.post_attention_layernorm(x))
                continue
            f = plan[i]
            x = x + self._attention(i, f.input_norm(x), cos, sin, meta, kv, f)
            x = x + f.mlp(layer, f.post_norm(x), _mlp)
        if logits_indices is not None:
            x = x.index_select(0, logits_indices.long())
        logits = self.lm_head((self.norm if plan is None else self._final_norm)(x))
        if not aux:  # no auxiliary layers (no drafter): an empty [T, 0] feature tensor
            return logits, x.new_empty((input_ids.shape[0], 0))
        return logits, torch.cat(aux, dim=-1)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
