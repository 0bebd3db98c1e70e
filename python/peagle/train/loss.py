"""Soft-label distillation loss against the target distribution (SPEC.md §8.6).

peagle uses the forward KL divergence ``KL(p_target || q_draft) = sum_v p(v) (log p(v) - log q(v))``
per supervised element (the speculators / NeMo form). It differs from the soft cross-entropy
``-sum_v p(v) log q(v)`` by the target entropy, a constant, so both give the same gradient; the
logged value is the KL (0 = the drafter matches the target exactly). With a reduced draft
vocabulary the target distribution is restricted to the draft vocabulary and renormalised.
No per-depth weights: one sum over all supervised elements divided by their global count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def target_logprobs_on_draft_vocab(
    target_logits: torch.Tensor, draft_to_target: torch.Tensor | None
) -> torch.Tensor:
    """``[R, V_d]`` float32 (float64 stays) log-probabilities of the target on the draft vocab.

    Args:
        target_logits: ``[R, V]`` target logits (any float dtype).
        draft_to_target: ``[V_d]`` int64 target id of each draft id, or None (V_d = V).
    """
    logits = _at_least_fp32(target_logits)
    if draft_to_target is not None:
        logits = logits.index_select(-1, draft_to_target)
    return F.log_softmax(logits, dim=-1)


def kl_per_element(draft_logits: torch.Tensor, target_logp: torch.Tensor) -> torch.Tensor:
    """``[R]`` ``KL(p || q)`` with ``q = softmax(draft_logits)``, in float32 (float64 inputs stay
    float64)."""
    logq = F.log_softmax(_at_least_fp32(draft_logits), dim=-1)
    return F.kl_div(logq, target_logp, log_target=True, reduction="none").sum(-1)
