"""Independent pure-PyTorch reference for ``paged_attention`` (SPEC §5).

The attention reference gathers each request's pages into a dense ``[kv_len, Hkv, D]`` tensor,
expands the KV heads to the query heads, and runs a dense masked softmax per request. It shares
no code with the C++ kernels. ``compute_dtype=torch.float64`` gives the accurate reference;
``compute_dtype=query.dtype`` gives the same computation at the input precision, used by the
FlashAttention-3 tolerance rule (:func:`assert_fa3_close`).
"""

from __future__ import annotations

import math

import torch


def gather_pages(
    cache: torch.Tensor, table_row: torch.Tensor, num_keys: int, block_size: int
) -> torch.Tensor:
    """Keys ``0 .. num_keys-1`` of one request as a dense ``[num_keys, Hkv, D]`` tensor."""
    if num_keys == 0:
        return cache.new_empty(0, cache.shape[2], cache.shape[3])
    n_blocks = -(-num_keys // block_size)
    pages = cache[table_row[:n_blocks].long()]  # [n_blocks, block_size, Hkv, D]
    return pages.reshape(n_blocks * block_size, cache.shape[2], cache.shape[3])[:num_keys]


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float | None = None,
    window_left: int = -1,
    sinks: torch.Tensor | None = None,
    key_capacity: int | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(out [T, Hq, D], lse [T, Hq])`` in ``compute_dtype`` (lse in float64 for a
    float64 reference, else float32), on the CPU.

    Row ``i`` of a request with ``qlen`` rows and ``kv_len`` keys sees keys
    ``max(0, kv_len - qlen + i - window_left) <= k <= kv_len - qlen + i`` (no lower bound for
    ``window_left < 0``) and ``k < key_capacity`` when given. Rows outside every request and rows
    that see no key get 0 and lse ``-inf`` (lse ``sinks[h]`` with sinks).
    """
    q_all = query.detach().cpu()
    kc, vc = key_cache.detach().cpu(), value_cache.detach().cpu()
    table = block_table.detach().cpu()
    qsl = query_start_loc.detach().cpu().tolist()
    lens = seq_lens.detach().cpu().tolist()
    t_total, hq, d = q_all.shape
    hkv, block_size = kc.shape[2], kc.shape[1]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    lse_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    out = torch.zeros(t_total, hq, d, dtype=compute_dtype)
    lse = torch.full((t_total, hq), -math.inf, dtype=lse_dtype)
    sink_col = None
    if sinks is not None:
        sink_col = sinks.detach().cpu().to(compute_dtype)

    for r in range(len(lens)):
        q0, q1 = qsl[r], qsl[r + 1]
        qlen, kv_len = q1 - q0, lens[r]
        if qlen == 0:
            continue
        rows = torch.arange(qlen)
        hi = kv_len - qlen + rows  # [qlen]
        lo = torch.clamp(hi - window_left, min=0) if window_left >= 0 else torch.zeros_like(hi)
        if key_capacity is not None:
            hi = torch.clamp(hi, max=key_capacity - 1)
        n_keys = kv_len if key_capacity is None else min(kv_len, key_capacity)
        q = q_all[q0:q1].to(compute_dtype)  # [qlen, Hq, D]
        if n_keys > 0:
            k = gather_pages(kc, table[r], n_keys, block_size).to(compute_dtype)
            v = gather_pages(vc, table[r], n_keys, block_size).to(compute_dtype)
            k = k.repeat_interleave(group, dim=1)  # [kv, Hq, D]
            v = v.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, qlen, kv]
            keys = torch.arange(n_keys)
            visible = (keys[None, :] <= hi[:, None]) & (keys[None, :] >= lo[:, None])
        else:
            v = torch.zeros(0, hq, d, dtype=compute_dtype)
            scores = torch.zeros(hq, qlen, 0, dtype=compute_dtype)
            visible = torch.zeros(qlen, 0, dtype=torch.bool)
        scores = scores.masked_fill(~visible[None], -math.inf)
        if sink_col is not None:
            sink = sink_col[:, None, None].expand(hq, qlen, 1)
            logits = torch.cat([scores, sink], dim=-1)
        else:
            logits = scores
        row_lse = torch.logsumexp(logits.to(lse_dtype), dim=-1)  # [Hq, qlen]
        probs = torch.softmax(logits, dim=-1)[..., : scores.shape[-1]]
        o = torch.einsum("hqk,khd->qhd", probs, v)
        empty = ~visible.any(dim=-1)  # [qlen]
        o[empty] = 0
        if sink_col is None:
            row_lse[:, empty] = -math.inf
        out[q0:q1] = o
        lse[q0:q1] = row_lse.transpose(0, 1)
    return out, lse


def assert_fa3_close(
    out: torch.Tensor,
    ref: torch.Tensor,
    ref_pt: torch.Tensor,
    rtol: float = 2.0,
    what: str = "out",
) -> None:
    """FlashAttention-3's rule: ``max|out - ref| <= rtol * max|out_pt - ref| + atol`` where
    ``ref`` is the float64 reference, ``ref_pt`` the same reference at the input precision and
    ``atol`` the error of rounding ``ref`` to ``out``'s dtype (plus a tiny floor)."""
    out64 = out.detach().cpu().double()
    ref64 = ref.double()
    atol = (ref64.to(out.dtype).double() - ref64).abs().max().item() if ref64.numel() else 0.0
    err = (out64 - ref64).abs().max().item() if ref64.numel() else 0.0
    err_pt = (ref_pt.double() - ref64).abs().max().item() if ref64.numel() else 0.0
    bound = rtol * err_pt + atol + 1e-6
    assert err <= bound, f"{what}: max error {err:.3e} > {rtol} * {err_pt:.3e} + {atol:.3e}"
