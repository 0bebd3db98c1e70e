"""The drafter forward over N×K layout elements under an arbitrary attention rule.

:meth:`peagle.models.Eagle3Drafter.forward` with the paged-KV attention replaced by a
caller-supplied ``attend(layer, q, k, v)`` (SPEC.md §2.2): the training mask (§8.3), or causal
attention in tests, which check this forward against the paged one.
"""

from __future__ import annotations

import torch

from peagle.models.drafter import AttendFn, Eagle3Drafter

__all__ = ["AttendFn", "masked_forward"]


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
    return drafter(input_ids, hidden_states, positions=positions, attend=attend)
