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
    """fp32 rows of the distribution ``peagle.verify_chain`` samples from (SPEC.md §6.9).

    ``logits``: [R, V], finite or -inf/NaN (NaN counts as -inf); one temperature, top-k and top-p
    for every row. Scores ``s = logit * (1.0f / T)`` in float32. Top-k (off if None, <= 0 or
    >= V) keeps ``s >= `` the k-th largest score: **every token tied with the k-th is kept**.
    Top-p (off if None or >= 1) then keeps ``v`` iff the top-k-kept mass of the scores strictly
    greater than ``s_v`` is < ``top_p`` * (top-k-kept mass), i.e. the nucleus is computed on the
    top-k-renormalised distribution and **a group of tied scores is kept or cut as a whole** (a
    group straddling the boundary is kept whole; the maximum always is). The kept set is
    ``{v : s_v >= tau}`` for one threshold, independent of sort order; masses are fp64. The result
    is softmax(s) over the kept set, 0 elsewhere.

    vLLM's sort-based ``apply_top_k_top_p`` also keeps the top-k ties but cuts top-p token by
    token in its (unstable) sort order, so it may keep only part of a tied group at the
    boundary; with bf16 logits such groups are common, and a reference that breaks them by sort
    order gives a legitimately sampled tied token probability 0.
    """
    inv_t = 1.0 / torch.tensor(temperature, dtype=torch.float32)
    s = logits.float() * inv_t.to(logits.device)
    s = torch.nan_to_num(s, nan=-torch.inf, posinf=torch.inf, neginf=-torch.inf).double()
    v = s.shape[-1]
    keep = s > -torch.inf
    if top_k is not None and 0 < top_k < v:
        kth = s.topk(top_k, dim=-1).values[..., -1:]  # the k-th largest score; ties at it kept
        keep = s >= kth
    if top_p is not None and top_p < 1.0:
        m = s.max(dim=-1, keepdim=True).values
        w = torch.where(keep, torch.exp(s - m), torch.zeros_like(s))
        asc, order = s.sort(dim=-1)
        cum = w.gather(-1, order).cumsum(dim=-1)
        total = cum[..., -1:]
        n_le = torch.searchsorted(asc, s, right=True)  # tokens with a score <= s_v (>= 1)
        mass_gt = total - cum.gather(-1, n_le - 1)  # kept mass strictly above s_v
        target = float(torch.tensor(top_p, dtype=torch.float32)) * total
        keep = keep & (mass_gt < target)
    masked = torch.where(keep, s, torch.full_like(s, -torch.inf))
    return torch.softmax(masked, dim=-1).float()
