"""vLLM's chain rejection sampling on ``torch.ops.peagle.verify_chain`` (SPEC.md §6).

vLLM 0.28's ``RejectionSampler.forward`` (``vllm/v1/sample/rejection_sampler.py``) samples the
bonus tokens with its regular sampler, applies the logits processors, temperature and top-k/top-p
to the draft rows' logits, and then calls the module function ``rejection_sample``. Only that
function is replaced, so every sampling feature applied before it (penalties, bad words, allowed
tokens, min-tokens, thinking budget, temperature, top-k/top-p, logprobs) stays vLLM's own.

Inside ``rejection_sample`` vLLM draws, in this order, float64 acceptance uniforms
(``generate_uniform_probs``: ``torch.rand(T)`` then per-request generators) and, unless every
request is greedy, one float32 Exp(1) row per request (``exponential_()`` on ``[B, V]``, then the
rows of seeded requests with drafts redrawn with their generator). The replacement draws the
same numbers in the same order and hands them to ``verify_chain`` (``uniforms``,
``exponentials``) together with vLLM's bonus tokens (``bonus_token_ids``), so the emitted tokens
are vLLM's.

The logits it receives are already temperature-scaled and top-k/top-p masked, so ``verify_chain``
gets temperature 1 for random requests (``logit * 1.0f`` is exact) and 0 for greedy ones, and no
top-k/top-p.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch

from peagle import ops

# True while a RejectionSampler that uses peagle runs forward(); read by the rejection_sample
# stand-in installed into vLLM's module.
_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("peagle_vllm_verify", default=False)


def sampler_active() -> contextvars.ContextVar[bool]:
    return _ACTIVE


def draw_exponentials(
    num_draft_tokens: list[int],
    vocab_size: int,
    generators: dict[int, torch.Generator],
    device: torch.device,
) -> torch.Tensor:
    """``[B, V]`` float32 Exp(1) draws consumed exactly as vLLM 0.28's ``sample_recovered_tokens``.

    The global generator fills the whole tensor first; then each request ``i`` with its own
    generator and at least one draft gets its row redrawn from that generator (requests without
    drafts consume nothing from their generator).
    """
    e = torch.empty(len(num_draft_tokens), vocab_size, dtype=torch.float32, device=device)
    e.exponential_()
    for i, g in generators.items():
        if num_draft_tokens[i] > 0:
            e[i].exponential_(generator=g)
    return e


def interleave_bonus_rows(
    target_logits: torch.Tensor, cu_num_draft_tokens: torch.Tensor
) -> torch.Tensor:
    """``[T, V]`` draft-row logits -> ``[T + B, V]`` in ``verify_chain``'s layout.

    Request ``r``'s draft ``j`` (global index ``t = cu[r-1] + j``) goes to row ``t + r``; the
    bonus rows ``cu[r] + r`` are left unwritten (never read when ``bonus_token_ids`` is given).
    The request of each draft is found on the device (no host sync).
    """
    t, b = target_logits.shape[0], cu_num_draft_tokens.shape[0]
    full = target_logits.new_empty(t + b, target_logits.shape[1])
    if t == 0:
        return full
    pos = torch.arange(t, device=target_logits.device, dtype=cu_num_draft_tokens.dtype)
    req = torch.searchsorted(cu_num_draft_tokens, pos, right=True)
    full.index_copy_(0, pos.long() + req, target_logits)
    return full


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    max_spec_len: int,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    sampling_metadata: Any,
) -> torch.Tensor:
    """vLLM 0.28 ``rejection_sample`` (standard method, float32 exponentials) on ``verify_chain``.

    Args (vLLM's): ``draft_token_ids [T]`` int32, ``num_draft_tokens`` per request (host list),
    ``max_spec_len`` (output width minus one), ``cu_num_draft_tokens [B]`` int32 inclusive,
    ``draft_probs [T, V]`` fp32 or None (argmax drafts), ``target_logits [T, V]`` fp32 after
    vLLM's processors / temperature / top-k / top-p, ``bonus_token_ids [B, 1]`` from vLLM's
    sampler, ``sampling_metadata`` (``all_greedy``, ``temperature``, ``generators``).

    Returns:
        ``[B, max_spec_len + 1]`` int32: emitted tokens, then -1 (``PLACEHOLDER_TOKEN_ID``).
    """
    from vllm.v1.sample.rejection_sampler import generate_uniform_probs

    t, v = target_logits.shape
    dev = target_logits.device
    greedy = sampling_metadata.all_greedy or sampling_metadata.temperature is None
    uniforms = exponentials = None
    if not greedy:
        # Same draws, same order as vLLM: uniforms first, exponentials after.
        uniforms = generate_uniform_probs(t, num_draft_tokens, sampling_metadata.generators, dev)
        exponentials = draw_exponentials(num_draft_tokens, v, sampling_metadata.generators, dev)
    return verify_with_draws(
        draft_token_ids, cu_num_draft_tokens, max_spec_len, draft_probs, target_logits,
        bonus_token_ids, None if greedy else sampling_metadata.temperature, uniforms,
        exponentials,
    )  # fmt: skip


def verify_with_draws(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    max_spec_len: int,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    temperature: torch.Tensor | None,
    uniforms: torch.Tensor | None,
    exponentials: torch.Tensor | None,
) -> torch.Tensor:
    """The ``verify_chain`` call of :func:`rejection_sample`, given vLLM's random draws.

    ``temperature [B]`` is vLLM's (only ``== 0``, greedy, matters: the logits are already
    scaled), None when every request is greedy; ``uniforms [T]`` float64 and ``exponentials
    [B, V]`` float32 are required unless every request is greedy.
    """
    b = cu_num_draft_tokens.shape[0]
    dev = target_logits.device
    if temperature is None:
        scale = torch.zeros(b, dtype=torch.float32, device=dev)
    else:
        scale = (temperature != 0).to(torch.float32)
    zeros64 = torch.zeros(b, dtype=torch.int64, device=dev)
    out = ops.verify_chain(
        interleave_bonus_rows(target_logits, cu_num_draft_tokens),
        draft_token_ids.to(torch.int32),
        cu_num_draft_tokens.to(torch.int32),
        scale,
        zeros64,  # seeds: unused, every random number is given
        zeros64,  # offsets
        draft_probs=draft_probs,
        uniforms=uniforms,
        bonus_token_ids=bonus_token_ids.reshape(b).to(torch.int32),
        exponentials=exponentials,
        max_num_draft_tokens=max_spec_len,
    )
    return out.output_token_ids


def call_supported(
    draft_probs: torch.Tensor | None, target_logits: torch.Tensor, bonus_token_ids: torch.Tensor
) -> str | None:
    """Why this call cannot use the op (None when it can); host metadata only."""
    if target_logits.dtype != torch.float32 or target_logits.dim() != 2:
        return f"target logits are {target_logits.dtype} {tuple(target_logits.shape)}"
    if draft_probs is not None and (
        draft_probs.dtype != torch.float32 or draft_probs.shape != target_logits.shape
    ):
        return f"draft probs are {draft_probs.dtype} {tuple(draft_probs.shape)}"
    if bonus_token_ids.numel() != 0 and bonus_token_ids.device != target_logits.device:
        return "bonus tokens and logits are on different devices"
    return None
