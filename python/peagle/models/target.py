"""Target runner: a Hugging Face Llama-family causal LM over peagle's paged KV cache.

The model is loaded by transformers (config + safetensors weights); the runner reuses its modules
(embedding, RMSNorms, q/k/v/o projections, Qwen3's q/k norms, MLPs, rotary embedding, lm_head) and
replaces only attention: K/V rows go into a :class:`~peagle.models.paged.PagedKVCache` with
``peagle.write_kv_cache`` and attention runs with ``peagle.paged_attention``. One forward returns
the logits of the requested rows (the verify rows) and the EAGLE-3 auxiliary hidden states.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from peagle.models.paged import (
    AttentionMetadata,
    PagedKVCache,
    paged_attention_forward,
    rope_cos_sin,
)

# Decoder-only models whose layers are the Llama pre-norm block (Qwen3 adds per-head q/k RMSNorm,
# Qwen2 q/k/v biases, Mistral a sliding window); MoE and other block shapes are not supported.
SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen2", "mistral")


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3 default feature layers ``[2, L//2, L-3]`` (SPEC.md §2.1)."""
    return [2, num_layers // 2, num_layers - 3]


def _check_aux_layer_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    ids = [int(i) for i in ids]
    if len(ids) != 3:
        raise ValueError(f"EAGLE-3 needs exactly 3 auxiliary layer ids, got {ids}")
    if any(i < 0 or i >= num_layers for i in ids) or sorted(set(ids)) != ids:
        raise ValueError(
            f"auxiliary layer ids {ids} must be strictly increasing layer indices in "
            f"[0, {num_layers}) (vLLM collects them in layer order); a target with "
            f"{num_layers} layers has default {default_aux_layer_ids(num_layers)}"
        )
    return ids


class TargetRunner:
    """Runs a transformers ``*ForCausalLM`` (Llama 3, Qwen3 dense, ...) with a paged KV cache.

    Args:
        model: a loaded ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` / ``Qwen2ForCausalLM`` /
            ``MistralForCausalLM``.
        aux_layer_ids: the 3 target layers whose *input* residual stream feeds the drafter
            (default ``[2, L//2, L-3]``).

    Raises:
        ValueError: unsupported model type, bad auxiliary layer ids.
    """

    def __init__(self, model: torch.nn.Module, aux_layer_ids: Sequence[int] | None = None) -> None:
        cfg = model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"target model_type {cfg.model_type!r} is not supported; peagle runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family dense decoders)"
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
        self.aux_layer_ids = _check_aux_layer_ids(
            default_aux_layer_ids(self.num_layers) if aux_layer_ids is None else aux_layer_ids,
            self.num_layers,
        )
        self.window_left = [self._window_left(i) for i in range(self.num_layers)]

    def set_aux_layer_ids(self, aux_layer_ids: Sequence[int]) -> None:
        """Use these 3 layers' input residual streams as the drafter features (from the
        drafter's ``eagle_config.eagle_aux_hidden_state_layer_ids``)."""
        self.aux_layer_ids = _check_aux_layer_ids(aux_layer_ids, self.num_layers)

    def _window_left(self, i: int) -> int:
        # transformers' sliding window W: key k is visible to query q iff q - W < k <= q.
        cfg = self.config
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types:
            sliding = layer_types[i] == "sliding_attention"
        else:
            sliding = cfg.model_type == "mistral"
        return int(window) - 1 if sliding and window else -1

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        aux_layer_ids: Sequence[int] | None = None,
    ) -> TargetRunner:
        """Load config and weights with transformers (``AutoModelForCausalLM``)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.from_pretrained(path)
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{path}: target model_type {cfg.model_type!r} is not supported; peagle runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto")
        return cls(model.to(device), aux_layer_ids)

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
    ) -> torch.Tensor:
        attn = self.layers[i].self_attn
        t = x.shape[0]
        q = attn.q_proj(x).view(t, -1, self.head_dim)
        k = attn.k_proj(x).view(t, -1, self.head_dim)
        v = attn.v_proj(x).view(t, -1, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over head_dim before RoPE
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        o = paged_attention_forward(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            kv.layer(i),
            meta,
            softmax_scale=attn.scaling,
            window_left=self.window_left[i],
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
            streams at the input of the 3 auxiliary layers, concatenated in layer order.
        """
        x = self.embed_tokens(input_ids.long())
        cos, sin = rope_cos_sin(self.rotary_emb, x, meta.positions)
        aux = []
        for i, layer in enumerate(self.layers):
            if i in self.aux_layer_ids:
                aux.append(x)
            h = layer.input_layernorm(x)
            x = x + self._attention(i, h, cos, sin, meta, kv)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if logits_indices is not None:
            x = x.index_select(0, logits_indices.long())
        logits = self.lm_head(self.norm(x))
        return logits, torch.cat(aux, dim=-1)
