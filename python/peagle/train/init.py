"""A fresh drafter for a target model, and the reduced draft vocabulary (``d2t`` / ``t2d``)."""

from __future__ import annotations

import torch

from peagle.models.drafter import Eagle3Drafter
from peagle.models.drafter_config import ARCHITECTURE, DrafterConfig
from peagle.models.target import default_aux_layer_ids


def select_draft_vocab(token_counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent target ids (ties: lower id first), in ascending id order.

    Ascending order keeps ``d2t`` order-preserving, so argmax ties break as over the full
    vocabulary (SPEC.md §2.2).
    """
    v = token_counts.numel()
    if not 0 < size <= v:
        raise ValueError(f"draft vocab size must be in [1, {v}], got {size}")
    # Stable sort by descending count: equal counts keep ascending id order.
    order = torch.sort(-token_counts.to(torch.int64), stable=True).indices
    return order[:size].sort().values


def aux_layers_for(num_layers: int) -> list[int]:
    """``[2, L//2, L-3]`` when strictly increasing, else ``[1, L//2, L-1]`` (small targets)."""
    ids = default_aux_layer_ids(num_layers)
    if sorted(set(ids)) == ids and ids[0] >= 0 and ids[-1] < num_layers:
        return ids
    ids = [1, num_layers // 2, num_layers - 1]
    if num_layers < 4 or sorted(set(ids)) != ids:
        raise ValueError(
            f"a target needs >= 4 layers for 3 distinct feature layers, has {num_layers}"
        )
    return ids


def drafter_config_for_target(
    target_config,
    *,
    num_layers: int,
    intermediate_size: int | None = None,
    draft_vocab_size: int | None = None,
    mask_token_id: int | None = None,
    aux_layer_ids: list[int] | None = None,
    norm_before_residual: bool = False,
) -> DrafterConfig:
    """A drafter config matching a transformers target config (hidden size, heads, RoPE)."""
    t = target_config
    h = t.hidden_size
    heads = t.num_attention_heads
    head_dim = getattr(t, "head_dim", None) or h // heads
    rope_theta = getattr(t, "rope_theta", None)
    rope_scaling = getattr(t, "rope_scaling", None)
    params = getattr(t, "rope_parameters", None)
    if isinstance(params, dict):
        params = dict(params)
        rope_theta = params.pop("rope_theta", rope_theta)
        if params.get("rope_type", "default") != "default":
            rope_scaling = params
    ids = aux_layer_ids or aux_layers_for(t.num_hidden_layers)
    d = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": h,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(t, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size or t.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": getattr(t, "rms_norm_eps", 1e-6),
        "max_position_embeddings": t.max_position_embeddings,
        "rope_theta": float(rope_theta if rope_theta is not None else 10000.0),
        "rope_scaling": rope_scaling,
        "vocab_size": t.vocab_size,
        "draft_vocab_size": draft_vocab_size or t.vocab_size,
        "target_hidden_size": h,
        "norm_before_residual": bool(norm_before_residual),
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": ids},
    }
    if mask_token_id is not None:
        d["ptd_token_id"] = int(mask_token_id)
    return DrafterConfig.from_dict(d)


@torch.no_grad()
def init_drafter(
    cfg: DrafterConfig,
    target_model: torch.nn.Module,
    *,
    parallel: bool,
    draft_ids: torch.Tensor | None = None,
    seed: int = 0,
) -> Eagle3Drafter:
    """A float32 drafter initialised for training.

    Linear weights ~ N(0, 0.02), norms 1, ``embed_tokens`` copied from the target (trainable,
    including the mask-token row), ``lm_head`` from the target's rows of the draft vocabulary,
    ``mask_hidden`` ~ N(0, 1) (SPEC.md §8.6), ``d2t``/``t2d`` from ``draft_ids``.
    """
    gen = torch.Generator().manual_seed(seed)
    model = Eagle3Drafter(cfg, with_mask_hidden=parallel, with_t2d=draft_ids is not None)
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen) * 0.02)
            if mod.bias is not None:
                mod.bias.zero_()
    emb = target_model.get_input_embeddings().weight.detach().float().cpu()
    model.embed_tokens.weight.copy_(emb)
    head = target_model.get_output_embeddings().weight.detach().float().cpu()
    if draft_ids is not None:
        v_d = draft_ids.numel()
        model.lm_head.weight.copy_(head[draft_ids])
        model.d2t.copy_(draft_ids - torch.arange(v_d))
        model.t2d.zero_()
        model.t2d[draft_ids] = True
    else:
        model.lm_head.weight.copy_(head)
    if parallel:
        model.mask_hidden.copy_(torch.randn(model.mask_hidden.shape, generator=gen))
    return model
