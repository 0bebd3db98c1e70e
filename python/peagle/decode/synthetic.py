"""Synthetic acceptance: a benchmarking switch that draws verification's accept/reject decisions.

With :class:`SyntheticAcceptance` given to :class:`~peagle.decode.SpecDecoder`, every part of a
real decode step still runs (target pass over the K+1 rows per request, ``verify_chain``, KV
writes, CUDA graphs, the host step, the drafter), but the number of accepted drafts of request
``b`` is drawn: draft ``i`` (1-based) is accepted, given drafts ``1..i-1`` were, with probability
``r_i``. The emitted row is then ``drafts[:a]`` followed by the target's own (greedy, first-index
argmax) token at row ``a`` of the request's verified rows: the correction token after a
rejection, or the bonus token after a fully accepted chain. vLLM 0.33 has the same idea
(``rejection_sample_method="synthetic"``).

The emitted tokens are NOT the model's text: accepted drafts are whatever the drafter proposed.
Use it to measure speed at a given acceptance profile, never for outputs.

Draws are counter-based, on the device, keyed on ``(seed, request key, position of the draft)``
with an integer hash: no host sync, no generator state (CUDA-graph safe: replay, eager and CPU
draw the same numbers). The request key is the engine's request id (uploaded with the step's
staging), so a run is deterministic for a seed whatever the requests' sampling seeds. Each
position of a request is consulted at most once (the next step's drafts start after the emitted
tokens), so the decisions of successive steps are independent draws.

Requests without drafts (prefills) and CUDA-graph padding requests keep ``verify_chain``'s
outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27: every product of the hash fits in int64


def _mix32_int(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * _MUL) & _M32
    x ^= x >> 16
    x = (x * _MUL) & _M32
    return x ^ (x >> 16)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The integer hash of :func:`_mix32_int` on an int64 tensor of values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = (x * _MUL) & _M32
    x = x ^ (x >> 16)
    x = (x * _MUL) & _M32
    return x ^ (x >> 16)


def uniforms(seed: int, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """fp32 draws in ``[0, 1)`` (24-bit) keyed on ``(seed, keys, positions)`` (int64 tensors of
    one shape; keys and positions taken modulo 2**32)."""
    s = _mix32_int(seed ^ 0x9E3779B9) ^ _mix32_int((seed >> 32) + 0x7F4A7C15)
    h = _mix32((keys & _M32) ^ s)
    h = _mix32((positions & _M32) ^ h)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


@dataclass(frozen=True)
class SyntheticAcceptance:
    """Per-position conditional acceptance rates ``r_1..r_n`` (``r_n`` is used beyond ``n``) and
    the seed of the draws; ``name`` / ``source`` / ``rule`` describe where the rates come from."""

    rates: Sequence[float]
    seed: int = 0
    name: str = "custom"
    source: str = ""
    rule: str = ""
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        rates = tuple(float(r) for r in self.rates)
        if not rates:
            raise ValueError("synthetic acceptance needs at least one rate")
        if any(not 0.0 <= r <= 1.0 for r in rates):
            raise ValueError(f"acceptance rates must lie in [0, 1], got {rates}")
        object.__setattr__(self, "rates", rates)

    def rates_for(self, k: int) -> list[float]:
        """``r_1..r_k`` (the last rate repeated beyond the table)."""
        return [self.rates[min(i, len(self.rates) - 1)] for i in range(k)]

    def expected_acceptance_length(self, k: int) -> float:
        """``1 + sum_i prod_{j<=i} r_j``: the mean tokens emitted per step at K=k."""
        total, p = 1.0, 1.0
        for r in self.rates_for(k):
            p *= r
            total += p
        return total

    def to_dict(self, k: int | None = None) -> dict:
        d = {"synthetic_acceptance": True, "table": self.name, "rates": list(self.rates),
             "seed": self.seed, "source": self.source, "rule": self.rule}  # fmt: skip
        if k is not None:
            d["rates_used"] = self.rates_for(k)
        return d

    def rate_tensor(self, k: int, device: torch.device) -> torch.Tensor:
        """``r_1..r_k`` on ``device`` (cached; the engine builds it before any graph capture)."""
        key = (k, str(device))
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = torch.tensor(self.rates_for(k), dtype=torch.float32,
                                                device=device)  # fmt: skip
        return t

    def apply(
        self,
        logits: torch.Tensor,
        drafts: torch.Tensor,
        draft_positions: torch.Tensor,
        cu_num_draft_tokens: torch.Tensor,
        request_keys: torch.Tensor,
        request_mask: torch.Tensor | None,
        output_token_ids: torch.Tensor,
        num_accepted: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``verify_chain``'s ``(output_token_ids [B, K+1], num_accepted [B])`` with the
        decisions drawn (see the module docstring). ``logits`` ``[R, V]``: each request's draft
        rows then its bonus row; ``drafts`` / ``draft_positions`` ``[T_d]``; ``request_keys``
        ``[B]`` int64 (None: ``0..B-1``). No host sync."""
        b, width = output_token_ids.shape
        k = width - 1
        if k == 0 or drafts.numel() == 0:
            return output_token_ids, num_accepted
        dev = drafts.device
        if request_keys is None:
            request_keys = torch.arange(b, dtype=torch.int64, device=dev)
        cu = cu_num_draft_tokens.to(torch.int64)
        n = cu - torch.cat([cu.new_zeros(1), cu[:-1]])  # drafts per request
        start = cu - n
        j = torch.arange(k, device=dev)
        valid = j[None, :] < n[:, None]  # [B, K]
        idx = (start[:, None] + j[None, :]).clamp(0, drafts.numel() - 1)
        d = drafts.to(torch.int64)[idx]
        u = uniforms(self.seed, request_keys[:, None].expand(b, k), draft_positions[idx])
        accept = (u < self.rate_tensor(k, dev)[None, :]) & valid
        a = ((~accept).to(torch.int32).cumsum(1) == 0).sum(1)  # [B] leading accepted drafts
        # The target's own token at row a of the request (its rows start at start + b).
        row = start + torch.arange(b, device=dev) + a
        own = logits.index_select(0, row).argmax(-1)
        jj = torch.arange(width, device=dev)[None, :]
        d_full = torch.cat([d, d.new_zeros(b, 1)], 1)
        out = torch.where(jj < a[:, None], d_full, torch.where(jj == a[:, None], own[:, None], -1))
        use = n > 0
        if request_mask is not None:
            use = use & request_mask
        out = torch.where(use[:, None], out.to(output_token_ids.dtype), output_token_ids)
        acc = torch.where(use, a.to(num_accepted.dtype), num_accepted)
        return out, acc
