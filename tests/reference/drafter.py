"""Independent float64 reference of the EAGLE-3 / P-EAGLE drafter forward (SPEC.md §2.2).

Works on one dense sequence (full causal attention, no paging) straight from the checkpoint's
tensors (``state_dict`` names of SPEC §2.4) and ``config.json`` fields; shares no code with
``peagle.models``. Default RoPE only (``rope_theta``, no scaling). Qwen3 layers (``model_type``
``"qwen3"``: per-head RMSNorm of q and k before RoPE) and sliding windows (``sliding_window`` on
the layers ``layer_types`` marks ``"sliding_attention"``, all layers without ``layer_types``: a row
at position p sees keys at positions > p - window) follow transformers' Qwen3 definitions.
"""

from __future__ import annotations

import torch


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]  # [T, D/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]  # [T, 1, D/2]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _window(cfg, layer):
    w = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if w is None or (types is not None and types[layer] != "sliding_attention"):
        return None
    return w


def _attention(sd, prefix, x, pos, cfg, layer):
    t = x.shape[0]
    hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    q = (x @ sd[f"{prefix}.q_proj.weight"].T).view(t, hq, d)
    k = (x @ sd[f"{prefix}.k_proj.weight"].T).view(t, hkv, d)
    v = (x @ sd[f"{prefix}.v_proj.weight"].T).view(t, hkv, d)
    if cfg.get("model_type") == "qwen3":
        q = _rms(q, sd[f"{prefix}.q_norm.weight"], cfg["rms_norm_eps"])
        k = _rms(k, sd[f"{prefix}.k_norm.weight"], cfg["rms_norm_eps"])
    q, k = _rope(q, pos, cfg["rope_theta"]), _rope(k, pos, cfg["rope_theta"])
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    dist = pos[:, None] - pos[None, :]  # query position - key position
    hidden_key = dist < 0
    w = _window(cfg, layer)
    if w is not None:
        hidden_key = hidden_key | (dist >= w)
    s = s.masked_fill(hidden_key, float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(t, hq * d)
    return o @ sd[f"{prefix}.o_proj.weight"].T


def _mlp(sd, prefix, x):
    gate = x @ sd[f"{prefix}.gate_proj.weight"].T
    up = x @ sd[f"{prefix}.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ sd[f"{prefix}.down_proj.weight"].T


def drafter_forward_ref(
    state: dict[str, torch.Tensor],
    cfg: dict,
    input_ids: torch.Tensor,
    hidden: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence through the drafter.

    Args:
        state: checkpoint tensors (any float dtype; computed in float64).
        cfg: ``config.json`` dictionary.
        input_ids: ``[T]``; hidden: ``[T, H]`` projected features; positions: ``[T]``.

    Returns:
        ``(normed, prenorm, draft_ids)``: ``[T, H]`` float64 twice, and ``[T]`` argmax drafts
        mapped to target ids through ``d2t``.
    """
    sd = {k: (v.double() if v.is_floating_point() else v) for k, v in state.items()}
    eps = cfg["rms_norm_eps"]
    e = sd["embed_tokens.weight"][input_ids.long()]
    h = hidden.double()
    e1 = _rms(e, sd["midlayer.input_layernorm.weight"], eps)
    if cfg.get("norm_before_residual", False):
        h1 = _rms(h, sd["midlayer.hidden_norm.weight"], eps)
        residual = h1
    else:
        residual = h
        h1 = _rms(h, sd["midlayer.hidden_norm.weight"], eps)
    x = _attention(sd, "midlayer.self_attn", torch.cat([e1, h1], -1), positions, cfg, 0)
    residual = residual + x
    x = _mlp(
        sd, "midlayer.mlp", _rms(residual, sd["midlayer.post_attention_layernorm.weight"], eps)
    )
    for i in range(1, cfg["num_hidden_layers"]):
        p = f"layers.{i}"
        residual = residual + x
        x = _attention(
            sd,
            f"{p}.self_attn",
            _rms(residual, sd[f"{p}.input_layernorm.weight"], eps),
            positions,
            cfg,
            i,
        )
        residual = residual + x
        x = _mlp(sd, f"{p}.mlp", _rms(residual, sd[f"{p}.post_attention_layernorm.weight"], eps))
    prenorm = residual + x
    normed = _rms(prenorm, sd["norm.weight"], eps)
    logits = normed @ sd["lm_head.weight"].T * cfg.get("logit_scale", 1.0)
    idx = logits.argmax(-1)
    return normed, prenorm, idx + sd["d2t"][idx]
