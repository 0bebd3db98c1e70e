"""Tiny targets, drafters and sequences for the training tests (random weights, no downloads)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from peagle.train.init import drafter_config_for_target, init_drafter
from peagle.train.target_features import shift_sequence, target_forward

VOCAB = 53  # odd on purpose
MASK_ID = 52


def tiny_target(seed: int = 0, layers: int = 4, head_dim: int = 8) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=4 * head_dim,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        intermediate_size=48,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper target distributions than the 0.02 init gives
        model.lm_head.weight.mul_(20.0)
    return model


def tiny_drafter(target, *, parallel=True, layers=2, draft_ids=None, seed=1, dtype=torch.float64):
    cfg = drafter_config_for_target(
        target.config,
        num_layers=layers,
        draft_vocab_size=None if draft_ids is None else draft_ids.numel(),
        mask_token_id=MASK_ID if parallel else None,
    )
    d = init_drafter(cfg, target, parallel=parallel, draft_ids=draft_ids, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # larger random weights: attention patterns matter
        for p in d.parameters():
            if p.ndim == 2 and p is not d.embed_tokens.weight:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return d.to(dtype)


def tiny_sequence(
    target,
    drafter,
    length: int,
    seed: int = 0,
    *,
    loss_mask=None,
    doc_ids=None,
    dtype=torch.float64,
):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB - 1, (length,), generator=gen)
    aux, logits = target_forward(target, tokens, drafter.config.aux_layer_ids)
    d2t = None
    if drafter.config.draft_vocab_size != drafter.config.vocab_size:
        d2t = torch.arange(drafter.config.draft_vocab_size) + drafter.d2t
    seq = shift_sequence(
        tokens,
        aux.to(dtype),
        logits.to(dtype),
        loss_mask=loss_mask,
        doc_ids=doc_ids,
        draft_to_target=d2t,
    )
    return seq
