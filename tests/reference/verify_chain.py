"""Independent pure-PyTorch reference for ``peagle::verify_chain`` (SPEC.md §6, peagle's sampling
rules in §6.9), written from the specification, not from the C++ kernels.

Probabilities are float64. The only float32 step is the score ``s = logit * (1/T)``, which the
specification fixes in float32 (so that the top-k/top-p kept sets are defined on the same
numbers as in the kernels). All random draws are explicit inputs:

* ``uniforms`` [T] float64 — one acceptance draw per draft;
* ``u_recovered`` [B] and ``u_bonus`` [B] float64 — one inverse-CDF draw per request for the
  recovered token (first rejected position) and for the bonus token: the emitted token is the
  first ``v`` (vocabulary order) whose cumulative weight exceeds ``u * sum(weights)``;
* optionally ``exponentials`` [B, V] — vLLM's exponential race for the recovered token
  (``argmax residual / E``) instead of the inverse-CDF draw, and ``bonus_token_ids`` [B] — the bonus
  token given instead of sampled (greedy requests too).

Besides the outputs it returns ``margin`` [B] float64: the smallest distance of any decision the
request made from flipping (|u - p/q| for acceptance tests, for sampled tokens the distance of ``u *
W`` from the nearest edge of the chosen token's cumulative-weight interval relative to W, the log of
the ratio of the best and second-best ``residual / E`` in the exponential race; +inf for greedy
requests). Float rounding in the kernels may legitimately flip a decision only where this margin is
tiny.

"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class ReferenceOutput(NamedTuple):
    output_token_ids: torch.Tensor  # [B, max_n + 1] int32
    num_accepted: torch.Tensor  # [B] int32
    accepted_per_position: torch.Tensor  # [B, max_n] bool
    margin: torch.Tensor  # [B] float64


def scores(logits_row: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 scores s = logit * (1.0f / T) as specified, NaN -> -inf; returned as float64."""
    inv_t = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(temperature, dtype=torch.float32)
    s = logits_row.to(torch.float32) * inv_t
    s = torch.where(torch.isnan(s), torch.full_like(s, -math.inf), s)
    return s.to(torch.float64)


def kept_mask(s: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p kept set on float64 scores ``s`` [V] (SPEC §6.7, ops.verify_chain)."""
    v = s.shape[0]
    keep = torch.ones(v, dtype=torch.bool)
    if 0 < top_k < v:
        kth = torch.topk(s, top_k).values[-1]  # k-th largest score; ties at it are kept
        keep = s >= kth
    if top_p < 1.0:
        m = s.max()
        if math.isinf(float(m)) and float(m) > 0:  # +inf maximum: the +inf group is the nucleus
            return keep & torch.isposinf(s)
        w = torch.where(keep, torch.exp(s - m), torch.zeros_like(s))
        # Mass of kept tokens with a strictly greater score, via an ascending sort + cumsum.
        asc, order = torch.sort(s)
        cum = torch.cumsum(w[order], 0)
        total = cum[-1]
        n_le = torch.searchsorted(asc, s, right=True)  # tokens with score <= s_v
        mass_le = cum[n_le - 1]
        mass_gt = total - mass_le
        keep = keep & (mass_gt < top_p * total)
    return keep


def target_probs(s: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """softmax of the kept scores (float64); 0 outside the kept set and for -inf scores. A row
    whose maximum score is +inf is one-hot at its first +inf index (SPEC §6.7)."""
    masked = torch.where(keep, s, torch.full_like(s, -math.inf))
    posinf = torch.isposinf(masked)
    if posinf.any():
        p = torch.zeros_like(s)
        p[int(torch.nonzero(posinf)[0])] = 1.0
        return p
    if not torch.isfinite(masked).any():
        return torch.zeros_like(s)
    return torch.softmax(masked, dim=0)


def _inverse_cdf(weights: torch.Tensor, u: float) -> tuple[int | None, float]:
    """First ``v`` whose cumulative weight (float64, vocabulary order) exceeds ``u * W``; None if
    every weight is 0. Also returns the relative distance of ``u * W`` from the nearest edge of the
    chosen token's interval (how far the draw is from landing on a neighbour)."""
    w = torch.clamp(torch.nan_to_num(weights.to(torch.float64), nan=0.0), min=0.0)
    total = float(w.sum())
    if not total > 0.0:
        return None, math.inf
    cum = torch.cumsum(w, 0)
    t = u * total
    idx = int(torch.searchsorted(cum, torch.tensor([t], dtype=torch.float64), right=True)[0])
    idx = min(idx, w.shape[0] - 1)
    hi = float(cum[idx])
    lo = hi - float(w[idx])
    return idx, min(t - lo, hi - t) / total


def _exponential_race(residual: torch.Tensor, e_row: torch.Tensor) -> tuple[int | None, float]:
    """First-index argmax of ``residual / E`` over ``residual > 0`` (None if there is none) and the
    log-ratio gap between the best and second-best candidate."""
    pos = residual > 0
    if not pos.any():
        return None, math.inf
    ratio = torch.where(pos, residual / e_row, torch.full_like(residual, -math.inf))
    idx = int(torch.argmax(ratio))
    vals = ratio[pos]
    if vals.numel() < 2:
        return idx, math.inf
    top2 = torch.topk(vals, 2).values
    if not (top2[1] > 0 and math.isfinite(float(top2[0]))):
        return idx, math.inf
    return idx, float(torch.log(top2[0] / top2[1]))


def verify_chain_reference(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    temperature: torch.Tensor,
    uniforms: torch.Tensor,
    u_recovered: torch.Tensor,
    u_bonus: torch.Tensor,
    *,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    request_mask: torch.Tensor | None = None,
    max_num_draft_tokens: int | None = None,
    exponentials: torch.Tensor | None = None,
    bonus_token_ids: torch.Tensor | None = None,
) -> ReferenceOutput:
    logits = target_logits.detach().cpu()
    drafts = draft_token_ids.cpu().tolist()
    cu = cu_num_draft_tokens.cpu().tolist()
    temps = temperature.cpu().tolist()
    u_all = uniforms.cpu().to(torch.float64)
    u_rec = u_recovered.cpu().to(torch.float64).tolist()
    u_bon = u_bonus.cpu().to(torch.float64).tolist()
    ks = top_k.cpu().tolist() if top_k is not None else [0] * len(cu)
    ps = top_p.cpu().tolist() if top_p is not None else [1.0] * len(cu)
    q_all = draft_probs.cpu().to(torch.float64) if draft_probs is not None else None
    mask = request_mask.cpu().tolist() if request_mask is not None else [True] * len(cu)
    e_all = exponentials.cpu().to(torch.float64) if exponentials is not None else None
    bonus_ids = bonus_token_ids.cpu().tolist() if bonus_token_ids is not None else None
    b, v = len(cu), logits.shape[1]
    counts = [cu[i] - (cu[i - 1] if i else 0) for i in range(b)]
    max_n = max_num_draft_tokens if max_num_draft_tokens is not None else max(counts, default=0)

    out = torch.full((b, max_n + 1), -1, dtype=torch.int32)
    num_acc = torch.zeros(b, dtype=torch.int32)
    margin = torch.full((b,), math.inf, dtype=torch.float64)
    for r in range(b):
        if not mask[r]:
            continue
        d0 = cu[r - 1] if r else 0
        n = counts[r]
        row0 = d0 + r  # n draft rows, then the bonus row
        greedy = temps[r] == 0.0
        emitted: list[int] = []
        rejected = False
        for j in range(n):
            row = logits[row0 + j].to(torch.float64)
            x = drafts[d0 + j]
            if greedy:
                a = int(torch.argmax(torch.nan_to_num(row, nan=-math.inf)))
                if x != a:
                    emitted.append(a)
                    rejected = True
                    break
                emitted.append(x)
                continue
            s = scores(logits[row0 + j], temps[r])
            keep = kept_mask(s, ks[r], ps[r])
            p = target_probs(s, keep)
            valid = 0 <= x < v
            p_x = float(p[x]) if valid else 0.0
            q_x = 1.0 if q_all is None else (float(q_all[d0 + j, x]) if valid else 0.0)
            u = float(u_all[d0 + j])
            if p_x > 0.0 and q_x > 0.0:
                ratio = p_x / q_x
                margin[r] = min(float(margin[r]), abs(u - ratio) / max(ratio, 1e-300))
                if u <= ratio:
                    emitted.append(x)
                    continue
            # Rejected: recovered token from the residual, with this request's noise row.
            if e_all is not None:  # vLLM's exponential race, no Philox draw
                if q_all is None:
                    res = p.clone()
                    if valid:
                        res[x] = 0.0
                else:
                    res = torch.clamp(p - q_all[d0 + j], min=0.0)
                tok, gap = _exponential_race(res, e_all[r])
                if tok is None:
                    tok = int(torch.argmax(torch.where(keep, s, torch.full_like(s, -math.inf))))
                margin[r] = min(float(margin[r]), gap)
                emitted.append(tok)
                rejected = True
                break
            if q_all is None:
                res = p.clone()
                if valid:
                    res[x] = 0.0  # p with the draft removed
            else:
                res = torch.clamp(p - q_all[d0 + j], min=0.0)
            tok, gap = _inverse_cdf(res, u_rec[r])
            if tok is None:  # empty residual: first-index argmax of p
                tok = int(torch.argmax(torch.where(keep, s, torch.full_like(s, -math.inf))))
            margin[r] = min(float(margin[r]), gap)
            emitted.append(tok)
            rejected = True
            break
        if not rejected and bonus_ids is not None:
            emitted.append(int(bonus_ids[r]))
        elif not rejected:
            bonus = logits[row0 + n]
            if greedy:
                emitted.append(int(torch.argmax(torch.nan_to_num(bonus.double(), nan=-math.inf))))
            else:
                s = scores(bonus, temps[r])
                keep = kept_mask(s, ks[r], ps[r])
                tok, gap = _inverse_cdf(target_probs(s, keep), u_bon[r])
                if tok is None:
                    tok = int(torch.argmax(s))
                margin[r] = min(float(margin[r]), gap)
                emitted.append(tok)
        out[r, : len(emitted)] = torch.tensor(emitted, dtype=torch.int32)
        num_acc[r] = len(emitted) - 1
    app = torch.arange(max_n).unsqueeze(0) < num_acc.unsqueeze(1)
    return ReferenceOutput(out, num_acc, app, margin)
