"""COD (conditional drop-token) sampling of the N×K training layout (SPEC.md §8.4).

An element is ``(anchor a, depth d)`` with reference position ``p = a + d`` (shifted
coordinates, §8.1). Depth 0 keeps every position. Depth ``d >= 1`` keeps

    min(floor(n_valid * max(r**d, r_min)), #candidates)

positions, drawn uniformly without replacement from the *candidates*: positions ``p >= 1`` whose
predecessor ``p - 1`` was kept at depth ``d - 1``, whose loss mask is 1 and that lie in the same
document as ``p - 1``. Every kept depth-``d`` element therefore keeps its depth-``(d-1)``
predecessor ``(a, d-1)`` in the same chain.

With ``max_anchors = M`` (speculators' ``max_anchors``) at most ``M`` chains start per document:
the depth-1 candidates of each document are cut to ``M`` drawn uniformly without replacement
(the *seeds*), and the counts above use the number of seeds instead of ``n_valid``. Depth 0 still
keeps every position, so most of the loss is on depth 0 when ``M`` is small.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Elements:
    """Elements of one sequence's layout, depth-major, ascending anchor within a depth.

    Attributes:
        anchors: ``[E]`` int64.
        depths: ``[E]`` int64.
    """

    anchors: torch.Tensor
    depths: torch.Tensor

    def __len__(self) -> int:
        return self.anchors.numel()

    @property
    def ref_positions(self) -> torch.Tensor:
        return self.anchors + self.depths


def cod_count(n_valid: int, depth: int, r: float, r_min: float) -> int:
    """Target number of kept positions at ``depth >= 1`` (before capping by the candidates)."""
    return int(math.floor(n_valid * max(r**depth, r_min)))


def cod_sample(
    n: int,
    num_depths: int,
    r: float,
    r_min: float,
    *,
    loss_mask: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    max_anchors: int | None = None,
) -> Elements:
    """Sample the COD layout of one sequence of ``n`` shifted positions.

    Args:
        n: positions (after the EAGLE shift).
        num_depths: K, the depths ``0..K-1``.
        r, r_min: retention ratio and floor (``0 <= r_min <= r <= 1``; r = 1 keeps every chain).
        loss_mask: ``[n]`` bool, label loss mask per reference position (default all True).
        doc_ids: ``[n]`` int document id per position (default one document).
        generator: CPU generator for the draws.
        max_anchors: at most this many chains (depth >= 1) start in each document (None: no
            cap; the draws without a cap are exactly those of earlier versions).

    Returns:
        :class:`Elements` on CPU.
    """
    if n < 0 or num_depths < 1:
        raise ValueError(f"need n >= 0 and num_depths >= 1, got n={n}, num_depths={num_depths}")
    if not (0.0 <= r_min <= 1.0 and 0.0 <= r <= 1.0):
        raise ValueError(f"COD ratios must lie in [0, 1], got r={r}, r_min={r_min}")
    lm = torch.ones(n, dtype=torch.bool) if loss_mask is None else loss_mask.to("cpu", torch.bool)
    if lm.shape != (n,):
        raise ValueError(f"loss_mask has shape {tuple(lm.shape)}, expected ({n},)")
    doc = None if doc_ids is None else doc_ids.to("cpu")
    n_valid = int(lm.sum())
    anchors = [torch.arange(n)]
    depths = [torch.zeros(n, dtype=torch.long)]
    kept = torch.ones(n, dtype=torch.bool)  # positions kept at the previous depth
    # Successor p of a kept position p - 1 is eligible if valid and in the same document.
    eligible = lm.clone()
    if n:
        eligible[0] = False
    if doc is not None and n > 1:
        eligible[1:] &= doc[1:] == doc[:-1]
    seeds = None
    if max_anchors is not None:
        seeds, n_valid = _cap_seeds(eligible, doc, max_anchors, generator)
    for d in range(1, num_depths):
        cand = torch.zeros(n, dtype=torch.bool)
        cand[1:] = kept[:-1]
        cand &= eligible
        if d == 1 and seeds is not None:
            cand &= seeds
        cand_pos = cand.nonzero().flatten()
        count = min(cod_count(n_valid, d, r, r_min), cand_pos.numel())
        if count <= 0:
            break
        pick = torch.randperm(cand_pos.numel(), generator=generator)[:count]
        pos = cand_pos[pick].sort().values
        kept = torch.zeros(n, dtype=torch.bool)
        kept[pos] = True
        anchors.append(pos - d)
        depths.append(torch.full((count,), d, dtype=torch.long))
    return Elements(torch.cat(anchors), torch.cat(depths))


def _cap_seeds(
    eligible: torch.Tensor,
    doc: torch.Tensor | None,
    max_anchors: int,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, int]:
    """``(seeds [n] bool, number of seeds)``: the depth-1 candidates (``eligible``) of each
    document, cut to ``max_anchors`` drawn uniformly without replacement (documents in order)."""
    if max_anchors < 0:
        raise ValueError(f"max_anchors must be >= 0, got {max_anchors}")
    pos = eligible.nonzero().flatten()
    seeds = torch.zeros_like(eligible)
    if pos.numel() == 0:
        return seeds, 0
    groups = [pos] if doc is None else [pos[doc[pos] == v] for v in torch.unique(doc[pos])]
    for g in groups:
        if g.numel() > max_anchors:
            g = g[torch.randperm(g.numel(), generator=generator)[:max_anchors]]
        seeds[g] = True
    return seeds, int(seeds.sum())
