"""Sequence partitioning, paper Algorithm 1 (SPEC.md §8.5).

A COD sample of a sequence of ``n`` positions is split into ``P`` segments that are run forward and
backward one after the other:

1. boundaries ``b_s = floor(s * n / P)``, ``s = 0..P``;
2. depth-0 and depth-1 elements go to the bucket of their reference position ``p``:
   ``A[p] = max{s < P : b_s <= p}``;
3. an element at depth ``g >= 2`` inherits the bucket of its chain predecessor, so every element
   at depth >= 1 lands in bucket ``A[anchor + 1]``;
4. causal completion: segment ``s`` also holds every depth-0 element with position ``< b_{s+1}``
   as key/value context that carries no loss.

With the loss of each segment divided by the *global* count of supervised elements, the segment
gradients sum to the single-pass gradient (tests/test_train_partition.py checks it in float64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peagle.train.cod import Elements


@dataclass
class Segment:
    """Element indices (into the COD sample) of one segment.

    Attributes:
        own: ``[E_s]`` elements whose loss this segment carries (its bucket).
        context: ``[C_s]`` depth-0 elements of earlier buckets copied in as context (no loss).
    """

    own: torch.Tensor
    context: torch.Tensor

    @property
    def indices(self) -> torch.Tensor:
        """Own elements first, then context copies."""
        return torch.cat([self.own, self.context])


def boundaries(n: int, num_partitions: int) -> torch.Tensor:
    """``[P+1]`` int64 segment boundaries ``floor(s * n / P)``."""
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    return torch.tensor([s * n // num_partitions for s in range(num_partitions + 1)])


def element_buckets(elems: Elements, n: int, num_partitions: int) -> torch.Tensor:
    """``[E]`` bucket of every element (steps 2-3)."""
    b = boundaries(n, num_partitions)
    key = torch.where(elems.depths == 0, elems.anchors, elems.anchors + 1)
    return torch.searchsorted(b[:num_partitions], key, right=True) - 1


def partition_elements(elems: Elements, n: int, num_partitions: int) -> list[Segment]:
    """Split a COD sample into segments (empty segments are dropped)."""
    b = boundaries(n, num_partitions)
    bucket = element_buckets(elems, n, num_partitions)
    depth0 = elems.depths == 0
    segments = []
    for s in range(num_partitions):
        own_mask = bucket == s
        if not bool(own_mask.any()):
            continue
        ctx_mask = depth0 & (elems.anchors < b[s + 1]) & ~own_mask
        segments.append(Segment(own_mask.nonzero().flatten(), ctx_mask.nonzero().flatten()))
    return segments
