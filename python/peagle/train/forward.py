"""The drafter forward over N×K layout elements under an arbitrary attention rule.

Same modules and the same math as :meth:`peagle.models.Eagle3Drafter.forward` (SPEC.md §2.2),
with the paged-KV attention replaced by a caller-supplied ``attend(layer, q, k, v)``: the training
mask (§8.3), or causal attention in tests, which check this forward against the paged one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from peagle.models.drafter import Eagle3Drafter
from peagle.models.paged import rope_cos_sin

# attend(layer_index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def masked_forward(
    drafter: Eagle3Drafter,
    input_ids: torch.Tensor,
    hidden_states: torch.Tensor,
    positions: torch.Tensor,
    attend: AttendFn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter forward over ``T`` rows.

    Args:
        input_ids: ``[T]`` token ids (mask rows carry the mask id).
        hidden_states: ``[T, H]`` projected features (``fc`` output, ``fc(mask_hidden)``, or the
            previous serial pass's pre-norm output).
        positions: ``[T]`` int64 RoPE positions.
        attend: attention of one layer, given post-RoPE q/k/v of these rows.

    Returns:
        ``(normed, prenorm)`` ``[T, H]``, as :meth:`Eagle3Drafter.forward`.
    """
    t = input_ids.shape[0]
    embeds = drafter.embed_tokens(input_ids.long())
    cos, sin = rope_cos_sin(drafter.rotary(), embeds, positions)
    x, residual = hidden_states, None
    for i, layer in enumerate(drafter.decoder_layers()):
        if layer.first:
            e = layer.input_layernorm(embeds)
            if layer.norm_before_residual:
                x = layer.hidden_norm(x)
                residual = x
            else:
                residual = x
                x = layer.hidden_norm(x)
            x = torch.cat([e, x], dim=-1)
        else:
            residual = residual + x
            x = layer.input_layernorm(residual)
        attn = layer.self_attn
        q = attn.q_proj(x).view(t, attn.num_heads, attn.head_dim)
        k = attn.k_proj(x).view(t, attn.num_kv_heads, attn.head_dim)
        v = attn.v_proj(x).view(t, attn.num_kv_heads, attn.head_dim)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        o = attend(i, q, k, v)
        residual = residual + attn.o_proj(o.reshape(t, -1))
        x = layer.mlp(layer.post_attention_layernorm(residual))
    prenorm = residual + x
    return drafter.norm(prenorm), prenorm
