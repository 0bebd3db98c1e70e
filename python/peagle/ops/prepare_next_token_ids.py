"""``prepare_next_token_ids``: Stage A of the draft step alone (SPEC.md §3.2, normative).

Also fused into :func:`peagle.ops.prepare_draft_inputs`. The C++ entry is
csrc/ops/prepare_draft_inputs.cpp.
"""

from __future__ import annotations

import torch

from peagle.ops._common import _ops, register_noop_fakes


def prepare_next_token_ids(
    sampled_token_ids: torch.Tensor,
    discard_request_mask: torch.Tensor,
    backup_next_token_ids: torch.Tensor,
    vocab_size: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage A alone (SPEC §3.2): ``(next_token_ids [B] int32, valid_sampled_tokens_count [B])``.

    For each request: discarded -> ``(backup, 0)``; otherwise the count of valid ids
    (``0 <= id < vocab_size``) in its ``[K+1]`` row and the id at the largest valid column, or
    the backup token when none is valid. Equivalent to vLLM's
    ``eagle_prepare_next_token_padded_kernel`` except that any negative id is invalid.

    Example:
        >>> import torch, peagle
        >>> sampled = torch.tensor([[5, 7, -1], [3, -1, -1]], dtype=torch.int32)
        >>> nxt, valid = peagle.prepare_next_token_ids(
        ...     sampled, torch.tensor([False, True]), torch.tensor([9, 4], dtype=torch.int32), 100)
        >>> nxt.tolist(), valid.tolist()
        ([7, 4], [2, 0])
    """
    b = sampled_token_ids.shape[0]
    if out is None:
        dev = sampled_token_ids.device
        out = (
            torch.empty(b, dtype=torch.int32, device=dev),
            torch.empty(b, dtype=torch.int32, device=dev),
        )
    _ops.prepare_next_token_ids.default(
        sampled_token_ids, discard_request_mask, backup_next_token_ids, vocab_size, out[0], out[1]
    )
    return out


register_noop_fakes("prepare_next_token_ids")
