"""Statistical checks for random benchmark outputs (the FlashInfer sampling peer, issue 21).

A sampler's outputs are not comparable token for token with another sampler's, so they are
checked against the distribution they should follow. Each sample may come from its own
distribution (one row of ``probs`` per sample): the randomized probability integral transform
``u = F(y-) + V * p(y)`` (``F`` the row's CDF in token order, ``V ~ U(0, 1)``) is uniform on
(0, 1) exactly when ``y`` is drawn from the row, for discrete rows too, so the pooled ``u`` of
all samples are binned and compared with the uniform counts by Pearson's chi-square.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ChiSquare:
    stat: float
    dof: int
    p_value: float
    n: int

    def ok(self, alpha: float = 1e-3) -> bool:
        """True unless the samples reject the distribution at level ``alpha``."""
        return self.p_value >= alpha


def chi_square_sf(stat: float, dof: int) -> float:
    """Survival function of the chi-square distribution (regularized upper gamma)."""
    s = torch.tensor(stat / 2.0, dtype=torch.float64)
    a = torch.tensor(dof / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(a, s))


def chi_square_pit(
    samples: torch.Tensor,
    probs: torch.Tensor,
    rows: torch.Tensor | None = None,
    bins: int = 20,
    generator: torch.Generator | None = None,
) -> ChiSquare:
    """Chi-square test that ``samples[i]`` was drawn from the row ``probs[rows[i]]``.

    ``samples``: [N] token ids; ``probs``: [R, V] (rows need not be normalised; they are);
    ``rows``: [N] row of each sample (default ``arange(N)``, then R = N). A sample outside its
    row's support (probability 0 or id out of range) fails the test outright (p = 0). ``bins``
    is capped so every bin expects >= 5 samples.
    """
    if rows is None:
        rows = torch.arange(samples.numel())
    if samples.dim() != 1 or probs.dim() != 2 or rows.shape != samples.shape:
        raise ValueError(f"want samples [N], probs [R, V], rows [N], got {samples.shape}, "
                         f"{probs.shape}, {rows.shape}")  # fmt: skip
    n = samples.numel()
    if n == 0:
        raise ValueError("no samples")
    p = probs.double().cpu()
    p = p / p.sum(dim=1, keepdim=True)
    cdf = p.cumsum(dim=1)
    ids = samples.long().cpu()
    rows = rows.long().cpu()
    valid = (ids >= 0) & (ids < p.shape[1])
    if not bool(valid.all()):
        return ChiSquare(float("inf"), 0, 0.0, n)
    p_y = p[rows, ids]
    if bool((p_y <= 0).any()):
        return ChiSquare(float("inf"), 0, 0.0, n)
    below = cdf[rows, ids] - p_y  # F(y-)
    v = torch.rand(n, generator=generator, dtype=torch.float64)
    u = (below + v * p_y).clamp(0.0, 1.0 - 1e-12)
    k = max(2, min(bins, n // 5))
    counts = torch.bincount((u * k).long(), minlength=k).double()
    expected = n / k
    stat = float(((counts - expected) ** 2 / expected).sum())
    return ChiSquare(stat, k - 1, chi_square_sf(stat, k - 1), n)


def target_probs(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """fp32 rows of the distribution verification samples from: softmax(logits / T), then the
    top-k filter (the k largest; ties at the k-th value kept), renormalised, then the top-p
    filter (the smallest set of largest tokens whose mass reaches p), renormalised."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_k is not None and 0 < top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if top_p is not None and top_p < 1.0:
        srt, idx = probs.sort(dim=-1, descending=True)
        before = srt.cumsum(dim=-1) - srt  # mass of the tokens ranked above
        keep = before < top_p
        srt = torch.where(keep, srt, torch.zeros_like(srt))
        probs = torch.zeros_like(probs).scatter_(-1, idx, srt)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
