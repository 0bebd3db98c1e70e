"""paged_attention vs the independent pure-PyTorch reference (SPEC §5, EDGE_CASES B/C6/D1).

Accuracy: FlashAttention-3's rule (STYLE.md) for bf16/fp16 -- no worse than twice the error of the
same reference run at the input precision, plus the rounding of the output; fp32 inputs (CPU only)
against the float64 reference directly. Inputs are fresh random data; pages that no request owns
and cache slots past each request's kv_len hold NaN, so a wrong page or an unmasked stale slot
shows up; outputs are poisoned before every call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from conftest import capture_graph, poison_, requires_cuda
from reference.paged_attention import assert_fa3_close, paged_attention_ref

import peagle

LOW_PRECISION = [torch.bfloat16, torch.float16]

# CUDA kernel variants (PEAGLE_ATTN_IMPL, read at every launch): "auto" is the default choice
# (wgmma on sm_90 for GQA groups >= 4, else mma.sync; 64-row query tiles for G <= 4, for G > 4
# 128, or 64 on the wgmma path where automatic splits meet a block table of little KV; 64-key KV
# tiles); the others force a tensor-core path, the query tile rows ("m64" / "m128") and/or 32-key
# KV tiles (head_dim 128 with 64-row query tiles, head_dim 64 with 128-row wgmma tiles); "wgmma"
# falls back to mma.sync off sm_90.
CUDA_IMPLS = ["auto", "mma", "wgmma", "mma-n32", "wgmma-n32", "wgmma-m64", "wgmma-m128"]


@pytest.fixture(params=CUDA_IMPLS)
def impl(request, device, monkeypatch) -> str:
    """Runs a test once per CUDA kernel variant (CPU: once)."""
    if request.param != "auto":
        if device != "cuda":
            pytest.skip("CUDA kernel variant")
        monkeypatch.setenv("PEAGLE_ATTN_IMPL", request.param)
    else:
        monkeypatch.delenv("PEAGLE_ATTN_IMPL", raising=False)
    return request.param


@pytest.fixture(params=CUDA_IMPLS)
def cuda_impl(request, monkeypatch) -> str:
    """impl for CUDA-only tests."""
    if request.param == "auto":
        monkeypatch.delenv("PEAGLE_ATTN_IMPL", raising=False)
    else:
        monkeypatch.setenv("PEAGLE_ATTN_IMPL", request.param)
    return request.param


@dataclass
class Problem:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor


def make_problem(
    gen: torch.Generator,
    q_lens: list[int],
    kv_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    *,
    layout: str = "split2",
    extra_cols: int = 2,
    table_fill: str = "garbage",
    max_blocks: int | None = None,
    t_pad: int = 0,
    q_offset: int = 0,
    strided_query: bool = False,
    poison_stale: bool = True,
) -> Problem:
    """Random paged problem. ``layout``: "plain" (contiguous caches), "split2" (halves of a
    ``[2, num_blocks, ...]`` tensor), "interleaved" (``[num_blocks, 2, ...]``), "padded"
    (``D`` sliced out of ``D + 8``) or "head_major" (``[num_blocks, Hkv, block_size, D]``
    permuted: slots ``D`` apart, heads a block's worth). ``table_fill``: what the unused
    block-table columns hold ("garbage" = huge/negative ids, "minus1")."""
    b = len(q_lens)
    needed = [-(-kv // block_size) for kv in kv_lens]
    width = max_blocks if max_blocks is not None else max(needed + [0]) + extra_cols
    num_blocks = sum(min(n, width) for n in needed) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    if table_fill == "garbage":
        table = torch.randint(-(2**30), 2**30, (b, width), generator=gen, dtype=torch.int32)
        table[:, ::2] = -1
    else:
        table = torch.full((b, width), -1, dtype=torch.int32)
    used = torch.zeros(num_blocks, dtype=torch.bool)
    nxt = 0
    for r, n in enumerate(needed):
        n = min(n, width)
        table[r, :n] = perm[nxt : nxt + n].to(torch.int32)
        used[perm[nxt : nxt + n]] = True
        nxt += n

    shape = (num_blocks, block_size, hkv, d)
    if layout == "plain":
        bases = [torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)]
        views = lambda x: (x[0], x[1])
    elif layout == "split2":
        bases = [torch.randn((2,) + shape, generator=gen)]
        views = lambda x: (x[0][0], x[0][1])
    elif layout == "interleaved":
        bases = [torch.randn((num_blocks, 2, block_size, hkv, d), generator=gen)]
        views = lambda x: (x[0][:, 0], x[0][:, 1])
    elif layout == "padded":
        padded = (num_blocks, block_size, hkv, d + 8)
        bases = [torch.randn(padded, generator=gen), torch.randn(padded, generator=gen)]
        views = lambda x: (x[0][..., :d], x[1][..., :d])
    elif layout == "head_major":
        hnd = (num_blocks, hkv, block_size, d)
        bases = [torch.randn(hnd, generator=gen), torch.randn(hnd, generator=gen)]
        views = lambda x: (x[0].permute(0, 2, 1, 3), x[1].permute(0, 2, 1, 3))
    else:
        raise ValueError(layout)
    kc, vc = views(bases)
    if poison_stale:
        kc[~used] = float("nan")
        vc[~used] = float("nan")
        for r, kv in enumerate(kv_lens):
            n = min(needed[r], width)
            if n and kv < n * block_size:
                last = int(table[r, n - 1])
                kc[last, kv - (n - 1) * block_size :] = float("nan")
                vc[last, kv - (n - 1) * block_size :] = float("nan")
    kc, vc = views([x.to(dtype=dtype, device=device) for x in bases])

    t = q_offset + sum(q_lens) + t_pad
    if strided_query:
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype=dtype, device=device)
        query = qkv[:, : hq * d].view(t, hq, d)
    else:
        query = torch.randn(t, hq, d, generator=gen).to(dtype=dtype, device=device)
    qsl = [q_offset]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    i32 = {"dtype": torch.int32, "device": device}
    return Problem(
        query=query,
        key_cache=kc,
        value_cache=vc,
        block_table=table.to(device),
        query_start_loc=torch.tensor(qsl, **i32),
        seq_lens=torch.tensor(kv_lens, **i32),
    )


def run_op(pb: Problem, **kw):
    """Calls the wrapper with poisoned preallocated outputs; returns (out, lse)."""
    out = poison_(torch.empty_like(pb.query, memory_format=torch.contiguous_format))
    lse = poison_(torch.empty(pb.query.shape[:2], dtype=torch.float32, device=pb.query.device))
    res = peagle.paged_attention(
        pb.query,
        pb.key_cache,
        pb.value_cache,
        pb.block_table,
        pb.query_start_loc,
        pb.seq_lens,
        return_lse=True,
        out=out,
        lse=lse,
        **kw,
    )
    assert res[0] is out and res[1] is lse
    return out, lse


def check_against_reference(pb: Problem, out, lse, key_capacity=None, **kw):
    ref_kw = {
        "softmax_scale": kw.get("softmax_scale"),
        "window_left": kw.get("window_left", -1),
        "sinks": kw.get("sinks"),
        "key_capacity": key_capacity,
    }
    args = (
        pb.query,
        pb.key_cache,
        pb.value_cache,
        pb.block_table,
        pb.query_start_loc,
        pb.seq_lens,
    )
    ref, ref_lse = paged_attention_ref(*args, **ref_kw)
    assert not torch.isnan(out).any(), "NaN in out (unwritten row or stale slot leaked)"
    assert not torch.isnan(lse).any(), "NaN in lse"
    if pb.query.dtype == torch.float32:
        torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=2e-5)
    else:
        ref_pt, _ = paged_attention_ref(*args, **ref_kw, compute_dtype=pb.query.dtype)
        assert_fa3_close(out, ref, ref_pt)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite), "lse -inf pattern differs"
    torch.testing.assert_close(lse.cpu().double()[finite], ref_lse[finite], rtol=0, atol=2e-4)
    assert torch.equal(lse.cpu()[~finite], ref_lse[~finite].float())


def skip_unsupported(device: str, dtype: torch.dtype, d: int, block_size: int) -> None:
    if device == "cuda" and (dtype == torch.float32 or d not in (64, 128) or block_size < 8):
        pytest.skip("not supported by the CUDA kernel (CPU-only case)")


# ---------------------------------------------------------------------------------------------
# Accuracy on ragged batches
# ---------------------------------------------------------------------------------------------

# (Hq, Hkv, D, block_size, layout): GQA ratios 1/4/8, head_dim 64/128, block sizes 8/16/32,
# every cache layout at least once.
SHAPES = [
    (8, 8, 64, 16, "split2"),
    (16, 4, 128, 8, "interleaved"),
    (32, 4, 64, 32, "plain"),
    (32, 8, 128, 16, "split2"),
    (64, 8, 64, 16, "padded"),
    (64, 8, 128, 16, "plain"),  # CUDA: 128-row tiles of 8 warps
    (32, 2, 64, 8, "split2"),  # GQA 16: a 14-row request spans two 128-row tiles
    (32, 8, 128, 32, "head_major"),  # slot stride != Hkv * D on the wgmma paths
    (64, 8, 64, 16, "head_major"),
]


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_ragged_batch_matches_reference(device, gen, dtype, shape, impl):
    hq, hkv, d, bs, layout = shape
    # Decode-shaped (14 rows), single row, short prefill, qlen > kv_len (B6).
    q_lens, kv_lens = [14, 1, 9, 6], [150, 37, 9, 3]
    pb = make_problem(gen, q_lens, kv_lens, hq, hkv, d, bs, dtype, device, layout=layout)
    out, lse = run_op(pb, max_query_len=14)
    check_against_reference(pb, out, lse)


def test_fp32_cpu_and_odd_shapes(gen):
    # CPU-only: fp32 inputs, odd head_dim, block sizes 1 and 2, GQA 3.
    for d, bs, hq, hkv in [(13, 1, 3, 1), (40, 2, 6, 2), (72, 4, 4, 4)]:
        pb = make_problem(gen, [3, 5], [7, 19], hq, hkv, d, bs, torch.float32, "cpu")
        out, lse = run_op(pb)
        check_against_reference(pb, out, lse)
    pb = make_problem(gen, [4, 2], [10, 33], 6, 2, 40, 4, torch.bfloat16, "cpu")
    out, lse = run_op(pb, softmax_scale=0.3)
    check_against_reference(pb, out, lse, softmax_scale=0.3)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_prefill_shaped(device, gen, dtype, impl):
    # Long query rows (prefill): several query tiles per request, causal triangle.
    pb = make_problem(gen, [70, 33], [70, 100], 16, 2, 128, 16, dtype, device, strided_query=True)
    out, lse = run_op(pb)
    check_against_reference(pb, out, lse)


def test_long_context_decode(device, gen, impl):
    # Long KV with a decode-shaped batch: the CUDA path splits the KV range.
    size = (3000, 1100) if device == "cuda" else (700, 260)
    pb = make_problem(gen, [14, 14], list(size), 32, 8, 128, 16, torch.bfloat16, device)
    out, lse = run_op(pb, max_query_len=14)
    check_against_reference(pb, out, lse)


@pytest.mark.parametrize("window_left", [0, 5, 40])
def test_sliding_window_and_sinks(device, gen, window_left, impl):
    q_lens, kv_lens = [14, 3, 4], [90, 2, 50]
    pb = make_problem(gen, q_lens, kv_lens, 16, 4, 64, 16, torch.bfloat16, device)
    sinks = (torch.randn(16, generator=gen) * 2).to(device)
    for kw in (
        {"window_left": window_left},
        {"sinks": sinks},
        {"window_left": window_left, "sinks": sinks},
    ):
        out, lse = run_op(pb, **kw)
        check_against_reference(pb, out, lse, **kw)


def test_sinks_on_empty_rows(device, gen):
    # Rows with no visible key: out 0, lse = sink value (and -inf without sinks).
    pb = make_problem(gen, [4, 2], [2, 0], 8, 2, 64, 8, torch.float16, device)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -3.0, 0.25, 4.0], device=device)
    out, lse = run_op(pb, sinks=sinks)
    check_against_reference(pb, out, lse, sinks=sinks)
    empty_rows = [0, 1, 4, 5]  # kv_len 2 < 4 rows: rows 0-1 see nothing; request 1 has no keys
    assert torch.all(out[empty_rows] == 0)
    assert torch.equal(lse[empty_rows].cpu(), sinks.cpu().expand(4, 8))


@pytest.mark.parametrize("scale", [-0.3, 0.0, 2.5])
def test_negative_zero_and_large_scales(device, gen, scale, impl):
    # The CUDA kernel takes exp2(s * |scale| * log2e - m) with Q's sign flipped for a negative
    # scale and |scale| clamped to FLT_MIN (so masked -inf scores stay -inf at scale 0).
    pb = make_problem(gen, [14, 5], [300, 37], 32, 8, 128, 16, torch.bfloat16, device)
    out, lse = run_op(pb, softmax_scale=scale, max_query_len=14)
    check_against_reference(pb, out, lse, softmax_scale=scale)
    out, lse = run_op(pb, softmax_scale=scale, max_query_len=14, num_splits=3)
    check_against_reference(pb, out, lse, softmax_scale=scale)


# ---------------------------------------------------------------------------------------------
# Edge cases (EDGE_CASES.md B1, B2, B4, B6, C6, D1)
# ---------------------------------------------------------------------------------------------


def test_fewer_keys_than_rows_b6(device, gen):
    pb = make_problem(gen, [4], [2], 8, 1, 64, 8, torch.bfloat16, device)
    out, lse = run_op(pb)
    check_against_reference(pb, out, lse)
    assert torch.all(out[:2] == 0) and torch.all(torch.isneginf(lse[:2]))
    assert torch.all(torch.isfinite(lse[2:]))


@pytest.mark.parametrize("q_rows", [1, 7])
def test_zero_length_request_b4(device, gen, q_rows):
    # kv_len 0 next to a real request; its block-table row is all -1 and must not be read.
    pb = make_problem(gen, [q_rows, 5], [0, 40], 8, 2, 64, 16, torch.bfloat16, device)
    pb.block_table[0] = -1
    out, lse = run_op(pb)
    check_against_reference(pb, out, lse)
    assert torch.all(out[:q_rows] == 0) and torch.all(torch.isneginf(lse[:q_rows]))
    # The real request is unaffected by its neighbour.
    alone = Problem(
        pb.query[q_rows:],
        pb.key_cache,
        pb.value_cache,
        pb.block_table[1:],
        pb.query_start_loc[1:] - q_rows,
        pb.seq_lens[1:],
    )
    out1, lse1 = run_op(alone, num_splits=1)
    out2, lse2 = run_op(pb, num_splits=1)
    assert torch.equal(out1, out2[q_rows:]) and torch.equal(lse1, lse2[q_rows:])


def test_padding_requests_and_tail_d1(device, gen):
    # A padding request (q_len 0, kv_len > 0, all -1 table row), a kv_len 0 request, and a
    # padded tail of rows past query_start_loc[B] (graph padding, counts not multiples of 1+K).
    pb = make_problem(
        gen, [5, 0, 3, 0], [20, 9, 0, 30], 8, 2, 64, 8, torch.bfloat16, device, t_pad=4
    )
    pb.block_table[1] = -1
    pb.block_table[2] = -1
    pb.block_table[3] = -1
    out, lse = run_op(pb, max_query_len=5)
    check_against_reference(pb, out, lse)
    assert torch.all(out[5:] == 0) and torch.all(torch.isneginf(lse[5:]))


def test_rows_before_first_request(device, gen):
    # query_start_loc[0] > 0: the leading rows belong to no request and are written inert.
    pb = make_problem(gen, [3, 2], [12, 30], 4, 4, 64, 16, torch.float16, device, q_offset=2)
    out, lse = run_op(pb)
    check_against_reference(pb, out, lse)
    assert torch.all(out[:2] == 0) and torch.all(torch.isneginf(lse[:2]))


def test_empty_batch_b2(device):
    dev = {"device": device}
    kc = torch.randn(4, 16, 2, 64, **dev).to(torch.bfloat16)
    for b, t in [(0, 0), (2, 0)]:
        q = torch.randn(t, 8, 64, **dev).to(torch.bfloat16)
        out, lse = peagle.paged_attention(
            q,
            kc,
            kc,
            torch.full((b, 3), -1, dtype=torch.int32, **dev),
            torch.zeros(b + 1, dtype=torch.int32, **dev),
            torch.zeros(b, dtype=torch.int32, **dev),
            return_lse=True,
        )
        assert out.shape == (t, 8, 64) and lse.shape == (t, 8)
    # B = 0 with padded rows: every row is inert.
    q = torch.randn(3, 8, 64, **dev).to(torch.bfloat16)
    out = poison_(torch.empty_like(q))
    lse = poison_(torch.empty(3, 8, **dev))
    empty_i32 = torch.zeros(0, dtype=torch.int32, **dev)
    peagle.paged_attention(
        q, kc, kc, empty_i32.view(0, 3), torch.zeros(1, dtype=torch.int32, **dev), empty_i32,
        return_lse=True, out=out, lse=lse,
    )  # fmt: skip
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


def test_block_table_capacity_b1(device, gen):
    # Page 16, table width 4 (capacity 64). Exactly at capacity (60 + 4) must pass.
    pb = make_problem(gen, [4], [64], 8, 2, 64, 16, torch.bfloat16, device, max_blocks=4)
    out, lse = run_op(pb)
    check_against_reference(pb, out, lse)
    # 62 + 4 = 66 keys need 5 columns: the CPU op raises; the CUDA kernel treats keys past the
    # capacity as invisible and never reads past the row.
    pb = make_problem(gen, [4, 3], [66, 20], 8, 2, 64, 16, torch.bfloat16, device, max_blocks=4)
    if device == "cpu":
        with pytest.raises(RuntimeError, match="block-table columns"):
            run_op(pb)
    else:
        out, lse = run_op(pb)
        check_against_reference(pb, out, lse, key_capacity=64)


def test_unused_table_columns_never_read(device, gen):
    # Unused columns hold -1 / huge ids; the tail of a request's own row too.
    for fill in ("garbage", "minus1"):
        pb = make_problem(
            gen, [14, 2], [33, 17], 16, 2, 128, 16, torch.bfloat16, device,
            extra_cols=6, table_fill=fill,
        )  # fmt: skip
        out, lse = run_op(pb)
        check_against_reference(pb, out, lse)


def test_output_views_and_default_scale(device, gen):
    # out as a strided view (rows of a wider buffer), lse omitted, default softmax scale.
    pb = make_problem(gen, [6, 2], [30, 11], 8, 4, 64, 8, torch.bfloat16, device)
    t = pb.query.shape[0]
    big = poison_(torch.empty(t, 8, 64 * 2, dtype=torch.bfloat16, device=device))
    view = big[:, :, :64]
    res = peagle.paged_attention(
        pb.query, pb.key_cache, pb.value_cache, pb.block_table, pb.query_start_loc, pb.seq_lens,
        out=view,
    )  # fmt: skip
    assert res is view
    ref, _ = paged_attention_ref(
        pb.query, pb.key_cache, pb.value_cache, pb.block_table, pb.query_start_loc, pb.seq_lens,
        softmax_scale=1 / math.sqrt(64),
    )  # fmt: skip
    ref_pt, _ = paged_attention_ref(
        pb.query, pb.key_cache, pb.value_cache, pb.block_table, pb.query_start_loc, pb.seq_lens,
        compute_dtype=torch.bfloat16,
    )  # fmt: skip
    assert_fa3_close(view, ref, ref_pt)
    assert torch.isnan(big[:, :, 64:]).all(), "wrote outside the output view"


def test_results_do_not_depend_on_hints(device, gen, impl):
    # max_query_len is only a launch hint, and a fixed split count is bit-reproducible.
    pb = make_problem(gen, [40, 14, 3], [300, 140, 3], 32, 8, 64, 16, torch.bfloat16, device)
    base = run_op(pb, num_splits=3)
    for hint in (1, 14, 40, -1):
        out, lse = run_op(pb, num_splits=3, max_query_len=hint)
        assert torch.equal(out, base[0]) and torch.equal(lse, base[1]), hint


# ---------------------------------------------------------------------------------------------
# Bad input: clear errors, never out of bounds
# ---------------------------------------------------------------------------------------------


def _args(pb: Problem) -> dict:
    return {
        "query": pb.query,
        "key_cache": pb.key_cache,
        "value_cache": pb.value_cache,
        "block_table": pb.block_table,
        "query_start_loc": pb.query_start_loc,
        "seq_lens": pb.seq_lens,
    }


def _call(a: dict, **kw):
    return peagle.paged_attention(
        a["query"], a["key_cache"], a["value_cache"], a["block_table"], a["query_start_loc"],
        a["seq_lens"], **kw,
    )  # fmt: skip


def test_bad_inputs(device, gen):
    pb = make_problem(gen, [3, 2], [10, 20], 8, 2, 64, 8, torch.bfloat16, device)
    a = _args(pb)
    dev = pb.query.device
    cases = [
        ({"query": pb.query.half()}, "key_cache must have dtype"),
        ({"query": pb.query[:, :7]}, "multiple of the cache's KV heads"),
        (
            {"query": pb.query[..., :32]},
            "head_dim" if device == "cuda" else "key_cache must have shape",
        ),
        ({"query": pb.query.transpose(1, 2)}, "unit stride|head_dim"),
        ({"query": pb.query.int()}, "dtype"),
        ({"key_cache": pb.key_cache[:, :6]}, "power of two"),
        ({"value_cache": pb.value_cache[..., :32]}, "value_cache must have shape"),
        ({"value_cache": pb.value_cache.float()}, "value_cache must have dtype"),
        ({"block_table": pb.block_table.long()}, "block_table must have dtype"),
        ({"block_table": pb.block_table[:1]}, "block_table must have B=2"),
        ({"query_start_loc": pb.query_start_loc.long()}, "query_start_loc must have dtype"),
        ({"seq_lens": pb.seq_lens[:1]}, "seq_lens must have shape"),
    ]
    for change, msg in cases:
        with pytest.raises(RuntimeError, match=msg):
            _call({**a, **change})
    out_cases = [
        ({"out": torch.empty(5, 8, 64, dtype=torch.float16, device=dev)}, "out must have dtype"),
        ({"out": torch.empty(4, 8, 64, dtype=torch.bfloat16, device=dev)}, "out must have shape"),
        ({"return_lse": True, "lse": torch.empty(5, 8, dtype=torch.double, device=dev)}, "lse"),
        ({"return_lse": True, "lse": torch.empty(8, 5, device=dev).t()}, "unit stride"),
        ({"sinks": torch.zeros(4, device=dev)}, "sinks must have shape"),
        ({"sinks": torch.zeros(8, dtype=torch.float16, device=dev)}, "sinks must have dtype"),
        ({"num_splits": -1}, "num_splits"),
        ({"num_splits": 100000}, "num_splits"),
        ({"max_query_len": -2}, "max_query_len"),
        ({"softmax_scale": float("nan")}, "softmax_scale"),
    ]  # fmt: skip
    for kw, msg in out_cases:
        with pytest.raises(RuntimeError, match=msg):
            _call(a, **kw)
    if device == "cpu":  # value checks need the data: CPU only
        bad_values = [
            ({"query_start_loc": torch.tensor([0, 4, 3], dtype=torch.int32)}, "non-decreasing"),
            ({"query_start_loc": torch.tensor([0, 3, 9], dtype=torch.int32)}, "exceeds the T"),
            ({"seq_lens": torch.tensor([10, -1], dtype=torch.int32)}, "negative"),
        ]
        for change, msg in bad_values:
            with pytest.raises(RuntimeError, match=msg):
                _call({**a, **change})
        bt = pb.block_table.clone()
        bt[1, 1] = -1
        with pytest.raises(RuntimeError, match=r"needs block_table\[1, 1\] = -1"):
            _call({**a, "block_table": bt})
        bt[1, 1] = pb.key_cache.shape[0]
        with pytest.raises(RuntimeError, match="not a block of the cache"):
            _call({**a, "block_table": bt})
        with pytest.raises(RuntimeError, match="float32 on CPU only|bfloat16"):
            _call({**a, "query": pb.query.to(torch.float64)})


@requires_cuda
def test_cuda_rejects_unsupported_shapes(gen):
    pb = make_problem(gen, [3], [10], 4, 2, 96, 16, torch.bfloat16, "cuda")
    with pytest.raises(RuntimeError, match="head_dim 64 and 128"):
        _call(_args(pb))
    pb = make_problem(gen, [3], [10], 4, 2, 64, 4, torch.bfloat16, "cuda")
    with pytest.raises(RuntimeError, match="power of two >= 8"):
        _call(_args(pb))
    pb = make_problem(gen, [3], [10], 4, 2, 64, 16, torch.float32, "cuda")
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        _call(_args(pb))
    # cp.async needs 16-byte aligned rows: a query view starting at an odd element is refused.
    pb = make_problem(gen, [3], [10], 4, 2, 64, 16, torch.bfloat16, "cuda")
    wide = torch.zeros(3, 4, 72, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        _call({**_args(pb), "query": wide[..., 1:65]})


# ---------------------------------------------------------------------------------------------
# torch.library / torch.compile integration
# ---------------------------------------------------------------------------------------------


def test_opcheck(device, gen):
    pb = make_problem(gen, [5, 2], [20, 9], 8, 2, 64, 8, torch.bfloat16, device, poison_stale=False)
    out = torch.empty_like(pb.query)
    lse = torch.empty(pb.query.shape[:2], device=device)
    sinks = torch.randn(8, generator=gen).to(device)
    args = (
        pb.query, pb.key_cache, pb.value_cache, pb.block_table, pb.query_start_loc, pb.seq_lens,
        0.125, 5, out, lse, 3, sinks, 0,
    )  # fmt: skip
    torch.library.opcheck(torch.ops.peagle.paged_attention.default, args)
    args_no_opt = args[:9] + (None, -1, None, 2)
    torch.library.opcheck(torch.ops.peagle.paged_attention.default, args_no_opt)


def test_torch_compile_fullgraph(device, gen):
    pb = make_problem(gen, [4, 3], [25, 13], 8, 2, 64, 16, torch.bfloat16, device)

    def step(q, kc, vc, bt, qsl, sl):
        out, lse = peagle.paged_attention(q, kc, vc, bt, qsl, sl, max_query_len=4, return_lse=True)
        return out * 2, lse

    compiled = torch.compile(step, fullgraph=True)
    args = (pb.query, pb.key_cache, pb.value_cache, pb.block_table, pb.query_start_loc, pb.seq_lens)
    got, got_lse = compiled(*args)
    want, want_lse = step(*args)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


# ---------------------------------------------------------------------------------------------
# CUDA-only: split-KV modes, reproducibility, CUDA graphs
# ---------------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("heads", [(32, 8, 128), (64, 8, 64), (8, 8, 64)])
def test_cuda_num_splits_agree_with_auto(gen, dtype, heads, cuda_impl):
    hq, hkv, d = heads
    pb = make_problem(gen, [14, 14, 1, 5], [4000, 900, 64, 3], hq, hkv, d, 16, dtype, "cuda")
    auto_out, auto_lse = run_op(pb, max_query_len=14)
    check_against_reference(pb, auto_out, auto_lse)
    tol = (
        {"rtol": 1.6e-2, "atol": 1.6e-2}
        if dtype == torch.bfloat16
        else {"rtol": 2e-3, "atol": 2e-3}
    )
    for ns in (1, 2, 3, 7, 16):
        out, lse = run_op(pb, max_query_len=14, num_splits=ns)
        torch.testing.assert_close(out.float(), auto_out.float(), **tol, msg=f"num_splits={ns}")
        torch.testing.assert_close(lse, auto_lse, rtol=0, atol=1e-4, msg=f"num_splits={ns}")


@requires_cuda
def test_cuda_bit_reproducible(gen, cuda_impl):
    pb = make_problem(
        gen, [14] * 6, [5000, 70, 2000, 14, 800, 3333], 32, 8, 128, 16, torch.bfloat16, "cuda"
    )
    for ns in (0, 7):
        first = run_op(pb, max_query_len=14, num_splits=ns)
        for _ in range(5):
            again = run_op(pb, max_query_len=14, num_splits=ns)
            assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@requires_cuda
@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
def test_cuda_block_sizes_and_tiles(gen, block_size, cuda_impl):
    # Pages smaller and larger than the 64-key tile; hint smaller than the real query length.
    pb = make_problem(gen, [14, 30, 2], [700, 95, 64], 32, 4, 64, block_size, torch.float16, "cuda")
    out, lse = run_op(pb, max_query_len=4)
    check_against_reference(pb, out, lse)


@requires_cuda
@pytest.mark.parametrize("heads", [(32, 8, 128), (64, 8, 64), (64, 8, 128)])
def test_cuda_long_single_request(gen, heads, cuda_impl):
    # B = 1 at 16k keys: the automatic split count is at its largest (merge of ~32 partials).
    hq, hkv, d = heads
    pb = make_problem(gen, [14], [16384], hq, hkv, d, 16, torch.bfloat16, "cuda")
    out, lse = run_op(pb, max_query_len=14)
    check_against_reference(pb, out, lse)


@requires_cuda
@pytest.mark.parametrize("heads", [(32, 8, 128), (64, 8, 64), (64, 8, 128), (16, 16, 64)])
def test_cuda_impls_agree(gen, heads, monkeypatch):
    # Every kernel variant computes the same function (up to fp32 accumulation order).
    hq, hkv, d = heads
    pb = make_problem(gen, [14, 14, 3], [2500, 700, 40], hq, hkv, d, 16, torch.bfloat16, "cuda")
    monkeypatch.delenv("PEAGLE_ATTN_IMPL", raising=False)
    base = run_op(pb, max_query_len=14, num_splits=4)
    check_against_reference(pb, *base)
    for name in CUDA_IMPLS[1:]:
        monkeypatch.setenv("PEAGLE_ATTN_IMPL", name)
        for ns in (4, 0):
            out, lse = run_op(pb, max_query_len=14, num_splits=ns)
            torch.testing.assert_close(
                out.float(), base[0].float(), rtol=1.6e-2, atol=1.6e-2, msg=f"{name} ns={ns}"
            )
            torch.testing.assert_close(lse, base[1], rtol=0, atol=1e-4, msg=f"{name} ns={ns}")


def _request_alone(pb: Problem, r: int, q_len: int) -> Problem:
    """Request r of pb as a batch of its own (same caches and table row)."""
    q0 = int(pb.query_start_loc[r])
    i32 = {"dtype": torch.int32, "device": pb.query.device}
    return Problem(pb.query[q0 : q0 + q_len], pb.key_cache, pb.value_cache,
                   pb.block_table[r : r + 1], torch.tensor([0, q_len], **i32),
                   pb.seq_lens[r : r + 1])  # fmt: skip


@requires_cuda
@pytest.mark.parametrize("heads", [(64, 8, 64), (32, 8, 128)])
def test_cuda_fixed_splits_result_independent_of_batch(gen, heads, monkeypatch):
    # A fixed num_splits makes a request's bits independent of the rest of the batch (the op's
    # contract), so the small-grid KV tile choice may apply under automatic splits only.
    monkeypatch.delenv("PEAGLE_ATTN_IMPL", raising=False)
    hq, hkv, d = heads
    kv = [3000, 700, 4100, 40, 2048, 999, 1500, 3333]
    pb = make_problem(gen, [14] * 8, kv, hq, hkv, d, 16, torch.bfloat16, "cuda")
    for r in (0, 2):
        alone = _request_alone(pb, r, 14)
        for ns in (1, 4):
            out_b, lse_b = run_op(pb, max_query_len=14, num_splits=ns)
            out_1, lse_1 = run_op(alone, max_query_len=14, num_splits=ns)
            rows = slice(14 * r, 14 * r + 14)
            assert torch.equal(out_b[rows], out_1), f"r={r} ns={ns}"
            assert torch.equal(lse_b[rows], lse_1), f"r={r} ns={ns}"


@requires_cuda
def test_cuda_short_kv_takes_64_row_query_tiles(gen, monkeypatch):
    # Automatic splits over a block table of <= 1024 * SMs keys in all (B * Hkv * capacity) run
    # the 64/8 x 64 wgmma kernel with 64-row query tiles, else 128-row ones: auto is bitwise the
    # forced variant. The table's width decides, not seq_lens (host-known: no sync).
    props = torch.cuda.get_device_properties(0)
    if (props.major, props.minor) != (9, 0):
        pytest.skip("the rule is for the sm_90 wgmma path")
    cases = [(1, None, "wgmma-m64"), (16, None, "wgmma-m128"), (1, 9000, "wgmma-m128")]
    for b, width, forced in cases:
        pb = make_problem(gen, [14] * b, [4000] * b, 64, 8, 64, 16, torch.bfloat16, "cuda",
                          max_blocks=width)  # fmt: skip
        monkeypatch.delenv("PEAGLE_ATTN_IMPL", raising=False)
        out_a, lse_a = run_op(pb, max_query_len=14)
        check_against_reference(pb, out_a, lse_a)
        monkeypatch.setenv("PEAGLE_ATTN_IMPL", forced)
        out_f, lse_f = run_op(pb, max_query_len=14)
        assert torch.equal(out_a, out_f), f"B={b} width={width}: auto != {forced}"
        assert torch.equal(lse_a, lse_f), f"B={b} width={width}: auto != {forced}"
    # A wider table is the same problem: the same answer (to rounding), whichever tile runs.
    pb = make_problem(gen, [14], [4000], 64, 8, 64, 16, torch.bfloat16, "cuda", max_blocks=9000)
    monkeypatch.delenv("PEAGLE_ATTN_IMPL", raising=False)
    out_w, _ = run_op(pb, max_query_len=14)
    narrow = Problem(pb.query, pb.key_cache, pb.value_cache, pb.block_table[:, :251],
                     pb.query_start_loc, pb.seq_lens)  # fmt: skip
    out_n, _ = run_op(narrow, max_query_len=14)
    torch.testing.assert_close(out_w.float(), out_n.float(), rtol=0, atol=2e-2)


@requires_cuda
def test_cuda_single_request_short_kv_takes_one_cta_per_sm_splits(gen, monkeypatch):
    # 32/8 x 128 with B * Hkv * 16 <= SMs over a table of <= 256 * SMs keys in all: automatic
    # splits run 32-key tiles with SMs // (B * Hkv) splits (one CTA per SM) -- bitwise the forced
    # n32 variant with that fixed split count. B = 2 or a wider table (kv 8k-style: 600 pages of
    # 16) keep the default: bitwise the forced 64-row, 64-key variant (a forced tile turns the
    # rule off).
    props = torch.cuda.get_device_properties(0)
    if (props.major, props.minor) != (9, 0):
        pytest.skip("the rule is for the sm_90 wgmma path")
    sms = props.multi_processor_count
    cases = [(1, None, True), (2, None, False), (1, 600, False), (1, 9000, False)]
    for b, width, rule in cases:
        pb = make_problem(gen, [14] * b, [4000] * b, 32, 8, 128, 16, torch.bfloat16, "cuda",
                          max_blocks=width)  # fmt: skip
        monkeypatch.delenv("PEAGLE_ATTN_IMPL", raising=False)
        out_a, lse_a = run_op(pb, max_query_len=14)
        check_against_reference(pb, out_a, lse_a)
        if rule:
            monkeypatch.setenv("PEAGLE_ATTN_IMPL", "wgmma-n32")
            out_f, lse_f = run_op(pb, max_query_len=14, num_splits=sms // (b * 8))
        else:
            monkeypatch.setenv("PEAGLE_ATTN_IMPL", "wgmma-m64")
            out_f, lse_f = run_op(pb, max_query_len=14)
        assert torch.equal(out_a, out_f), f"B={b} width={width}: auto != forced (rule={rule})"
        assert torch.equal(lse_a, lse_f), f"B={b} width={width}: auto != forced (rule={rule})"


@requires_cuda
def test_cuda_graph_replay_with_new_lengths(gen, cuda_impl):
    b, hq, hkv, d, bs, width = 4, 32, 8, 128, 16, 64
    pb = make_problem(gen, [14] * b, [width * bs] * b, hq, hkv, d, bs, torch.bfloat16, "cuda",
                      max_blocks=width, poison_stale=False)  # fmt: skip
    out = torch.empty_like(pb.query)
    lse = torch.empty(pb.query.shape[:2], device="cuda")
    static = Problem(pb.query.clone(), pb.key_cache, pb.value_cache, pb.block_table.clone(),
                     pb.query_start_loc.clone(), pb.seq_lens.clone())  # fmt: skip

    def call():
        peagle.paged_attention(
            static.query, static.key_cache, static.value_cache, static.block_table,
            static.query_start_loc, static.seq_lens, max_query_len=14, return_lse=True,
            out=out, lse=lse,
        )  # fmt: skip

    graph = capture_graph(call)
    for kv_lens in ([1024, 14, 3, 700], [5, 1000, 64, 0], [14, 14, 1024, 200]):
        static.seq_lens.copy_(torch.tensor(kv_lens, dtype=torch.int32))
        static.query.copy_(torch.randn(static.query.shape, generator=gen).to(torch.bfloat16))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_against_reference(static, out, lse)


# ---------------------------------------------------------------------------------------------
# Split merge inside the main kernel (sm_90+): thread-block clusters along the KV splits merge
# through distributed shared memory; with more splits than one cluster holds, the last cluster to
# arrive at a row slice (arrival counter, reset by it) merges the clusters' partials. The
# counters are a persistent zeroed buffer, so repeated calls and graph replays must leave them
# zeroed. The merge kernel is the default (measured faster on the H200); PEAGLE_ATTN_MERGE=cluster
# selects the cluster merge, which these tests pin.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(params=["auto", "cluster"])
def merge(request, monkeypatch) -> str:
    """Runs a CUDA test with the default split merge (the merge kernel) and the cluster merge."""
    if request.param == "auto":
        monkeypatch.delenv("PEAGLE_ATTN_MERGE", raising=False)
    else:
        monkeypatch.setenv("PEAGLE_ATTN_MERGE", request.param)
    return request.param


@pytest.fixture
def cluster_merge(monkeypatch) -> None:
    """Selects the in-kernel cluster merge (opt-in) for a CUDA test."""
    monkeypatch.setenv("PEAGLE_ATTN_MERGE", "cluster")


@requires_cuda
@pytest.mark.parametrize("heads", [(32, 8, 128), (64, 8, 64), (8, 8, 64)])
@pytest.mark.parametrize("num_splits", [0, 2, 5, 8, 16, 24, 33, 64])
def test_cuda_merge_many_splits_b1(gen, heads, num_splits, merge):
    # B = 1 decode at 16k keys: one cluster (<= 8 splits), two levels (16-64 splits), a last
    # cluster that is partly empty (5, 33), and the automatic plan (0: the benchmarked one).
    hq, hkv, d = heads
    pb = make_problem(gen, [14], [16384], hq, hkv, d, 16, torch.bfloat16, "cuda")
    out, lse = run_op(pb, max_query_len=14, num_splits=num_splits)
    check_against_reference(pb, out, lse)


@requires_cuda
@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("heads", [(32, 8, 128), (64, 8, 64)])
def test_cuda_merge_ragged_batch(gen, dtype, heads, cuda_impl):
    # B > 1, ragged: requests needing 1 .. many splits share one grid (clusters of a short
    # request skip, empty splits of an active cluster take part), a padding request, a window.
    hq, hkv, d = heads
    pb = make_problem(gen, [14, 14, 3, 1, 0, 14], [9000, 300, 5000, 16, 5, 2100], hq, hkv, d, 16,
                      dtype, "cuda", t_pad=3)  # fmt: skip
    for kw in ({}, {"num_splits": 24}, {"num_splits": 7}, {"window_left": 1500}):
        out, lse = run_op(pb, max_query_len=14, **kw)
        check_against_reference(pb, out, lse, **kw)


@requires_cuda
@pytest.mark.parametrize("heads", [(32, 8, 128), (64, 8, 64)])
def test_cuda_merge_paths_agree(gen, heads, monkeypatch):
    # Cluster merge and merge kernel compute the same function (fp32 summation order aside).
    hq, hkv, d = heads
    pb = make_problem(gen, [14, 14, 2], [12000, 700, 3000], hq, hkv, d, 16, torch.bfloat16, "cuda")
    sinks = torch.randn(hq, generator=gen).cuda()
    for ns in (0, 3, 16, 40):
        monkeypatch.setenv("PEAGLE_ATTN_MERGE", "kernel")
        base = run_op(pb, max_query_len=14, num_splits=ns, sinks=sinks)
        monkeypatch.setenv("PEAGLE_ATTN_MERGE", "cluster")
        out, lse = run_op(pb, max_query_len=14, num_splits=ns, sinks=sinks)
        check_against_reference(pb, out, lse, sinks=sinks)
        torch.testing.assert_close(out.float(), base[0].float(), rtol=1.6e-2, atol=1.6e-2)
        torch.testing.assert_close(lse, base[1], rtol=0, atol=1e-4)


@requires_cuda
def test_cuda_merge_repeated_calls_bit_identical(gen, cuda_impl, cluster_merge):
    # The arrival counters are reused by every call: a counter left non-zero would make a later
    # call merge early (wrong rows) or never (unwritten rows, NaN from the poisoned outputs).
    pb = make_problem(gen, [14, 5], [16384, 4000], 32, 8, 128, 16, torch.bfloat16, "cuda")
    for ns in (0, 24, 64):
        first = run_op(pb, max_query_len=14, num_splits=ns)
        check_against_reference(pb, *first)
        for _ in range(4):
            again = run_op(pb, max_query_len=14, num_splits=ns)
            assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@requires_cuda
def test_cuda_merge_two_shapes_back_to_back(gen, cluster_merge):
    # Different shapes (different slice -> counter maps, different cluster counts) alternate on
    # one stream without a sync in between; each must match its own first result.
    a = make_problem(gen, [14], [16384], 32, 8, 128, 16, torch.bfloat16, "cuda")
    b = make_problem(gen, [14, 14, 14], [8000, 100, 12000], 64, 8, 64, 16, torch.bfloat16, "cuda")
    ref_a, ref_b = run_op(a, max_query_len=14), run_op(b, max_query_len=14)
    check_against_reference(a, *ref_a)
    check_against_reference(b, *ref_b)
    outs = []
    for _ in range(3):
        outs.append((run_op(a, max_query_len=14), run_op(b, max_query_len=14, num_splits=40)))
    ref_b40 = run_op(b, max_query_len=14, num_splits=40)
    for oa, ob in outs:
        assert torch.equal(oa[0], ref_a[0]) and torch.equal(oa[1], ref_a[1])
        assert torch.equal(ob[0], ref_b40[0]) and torch.equal(ob[1], ref_b40[1])


@requires_cuda
def test_cuda_merge_two_streams(gen, cluster_merge):
    # Eager calls on two streams at once: each stream has its own counters.
    a = make_problem(gen, [14], [16384], 32, 8, 128, 16, torch.bfloat16, "cuda")
    b = make_problem(gen, [14], [12000], 32, 8, 128, 16, torch.bfloat16, "cuda")
    ref_a, ref_b = run_op(a, max_query_len=14), run_op(b, max_query_len=14)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    res = []
    for _ in range(4):
        for s, pb in zip(streams, (a, b), strict=True):
            with torch.cuda.stream(s):
                res.append((pb, run_op(pb, max_query_len=14)))
    torch.cuda.synchronize()
    for pb, (out, lse) in res:
        ref = ref_a if pb is a else ref_b
        assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])


@requires_cuda
@pytest.mark.parametrize("num_splits", [0, 24])
def test_cuda_graph_replay_reuses_merge_counters(gen, num_splits, cuda_impl, cluster_merge):
    # Graph replays reuse the counters with no memset node: the second replay (and one with new
    # lengths and queries) must give the eager answer exactly.
    b, hq, hkv, d, bs, width = 2, 32, 8, 128, 16, 1024
    pb = make_problem(gen, [14] * b, [width * bs] * b, hq, hkv, d, bs, torch.bfloat16, "cuda",
                      max_blocks=width, poison_stale=False)  # fmt: skip
    static = Problem(pb.query.clone(), pb.key_cache, pb.value_cache, pb.block_table.clone(),
                     pb.query_start_loc.clone(), pb.seq_lens.clone())  # fmt: skip
    static.seq_lens.copy_(torch.tensor([16384, 9000], dtype=torch.int32))
    out = torch.empty_like(pb.query)
    lse = torch.empty(pb.query.shape[:2], device="cuda")

    def call():
        peagle.paged_attention(
            static.query, static.key_cache, static.value_cache, static.block_table,
            static.query_start_loc, static.seq_lens, max_query_len=14, return_lse=True,
            out=out, lse=lse, num_splits=num_splits,
        )  # fmt: skip

    eager = run_op(static, max_query_len=14, num_splits=num_splits)
    graph = capture_graph(call)
    for _ in range(2):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
    check_against_reference(static, out, lse)
    for kv_lens in ([700, 16384], [16384, 0], [5000, 5000]):
        static.seq_lens.copy_(torch.tensor(kv_lens, dtype=torch.int32))
        static.query.copy_(torch.randn(static.query.shape, generator=gen).to(torch.bfloat16))
        for _ in range(2):
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            check_against_reference(static, out, lse)
        again = run_op(static, max_query_len=14, num_splits=num_splits)  # eager after replays
        assert torch.equal(out, again[0]) and torch.equal(lse, again[1])


# ---------------------------------------------------------------------------------------------
# Masked keys never affect a row, whatever they hold (SPEC §5, EDGE_CASES X4)
# ---------------------------------------------------------------------------------------------


def _set_keys(pb: Problem, r: int, keys: list[int], value: float, which: str) -> None:
    bs = pb.key_cache.shape[1]
    for key in keys:
        blk, slot = int(pb.block_table[r, key // bs]), key % bs
        if "k" in which:
            pb.key_cache[blk, slot] = value
        if "v" in which:
            pb.value_cache[blk, slot] = value


@pytest.mark.parametrize("which", ["kv", "v", "k"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_nonfinite_kv_in_causal_future_does_not_poison_earlier_rows(
    device, gen, dtype, d, which, impl
):
    # q_len 8 over 45 keys: row i sees keys 0..37+i. NaN/inf at keys 42..44 (seen by rows 5..7
    # only) must leave rows 0..4 bit-identical and equal to the reference; rows 5..7 see them and
    # are not finite. Unsplit, split (3) and automatic splits.
    pb = make_problem(gen, [8], [45], 8, 2, d, 16, dtype, device, layout="plain")
    for num_splits in (1, 3, 0):
        clean, clean_lse = run_op(pb, max_query_len=8, num_splits=num_splits)
        check_against_reference(pb, clean, clean_lse)
        for value in (float("nan"), float("inf")):
            pb2 = Problem(pb.query, pb.key_cache.clone(), pb.value_cache.clone(), pb.block_table,
                          pb.query_start_loc, pb.seq_lens)  # fmt: skip
            _set_keys(pb2, 0, [42, 43, 44], value, which)
            out, lse = run_op(pb2, max_query_len=8, num_splits=num_splits)
            assert torch.equal(out[:5], clean[:5]), (num_splits, value, "rows 0..4 changed")
            assert torch.equal(lse[:5], clean_lse[:5])
            assert not torch.isfinite(out[5:].float()).all(dim=-1).any(), "rows 5..7 see it"


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_nonfinite_kv_behind_sliding_window_does_not_poison_later_rows(device, gen, dtype, d, impl):
    # window_left 10: row i sees keys 27+i .. 37+i. NaN at key 27 is seen by row 0 only, at
    # keys 28..29 by rows <= 1 / <= 2: rows 3..7 must not change.
    pb = make_problem(gen, [8], [45], 8, 2, d, 16, dtype, device, layout="plain")
    for num_splits in (1, 2, 0):
        clean, clean_lse = run_op(pb, max_query_len=8, num_splits=num_splits, window_left=10)
        check_against_reference(pb, clean, clean_lse, window_left=10)
        pb2 = Problem(pb.query, pb.key_cache.clone(), pb.value_cache.clone(), pb.block_table,
                      pb.query_start_loc, pb.seq_lens)  # fmt: skip
        _set_keys(pb2, 0, [27, 28, 29], float("nan"), "kv")
        out, lse = run_op(pb2, max_query_len=8, num_splits=num_splits, window_left=10)
        assert torch.equal(out[3:], clean[3:]), (num_splits, "rows 3..7 changed")
        assert torch.equal(lse[3:], clean_lse[3:])
        assert not torch.isfinite(out[:3].float()).all(dim=-1).any(), "rows 0..2 see it"


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_nonfinite_kv_window_narrower_than_query_does_not_poison_other_rows(device, gen, dtype, d,
                                                                           impl):  # fmt: skip
    # window_left 3 < q_len 8: one tile holds both edges (the last row's first key lies past the
    # first row's last key), so every key of it is partly masked. Row i sees keys 34+i .. 37+i:
    # NaN at key 36 is seen by rows 0..2 only, inf at key 44 by row 7 only.
    pb = make_problem(gen, [8], [45], 8, 2, d, 16, dtype, device, layout="plain")
    for num_splits in (1, 2, 0):
        clean, clean_lse = run_op(pb, max_query_len=8, num_splits=num_splits, window_left=3)
        check_against_reference(pb, clean, clean_lse, window_left=3)
        pb2 = Problem(pb.query, pb.key_cache.clone(), pb.value_cache.clone(), pb.block_table,
                      pb.query_start_loc, pb.seq_lens)  # fmt: skip
        _set_keys(pb2, 0, [36], float("nan"), "kv")
        _set_keys(pb2, 0, [44], float("inf"), "v")
        out, lse = run_op(pb2, max_query_len=8, num_splits=num_splits, window_left=3)
        assert torch.equal(out[3:7], clean[3:7]), (num_splits, "rows 3..6 changed")
        assert torch.equal(lse[3:7], clean_lse[3:7])
        assert not torch.isfinite(out[:3].float()).all(dim=-1).any(), "rows 0..2 see the NaN"
        assert not torch.isfinite(out[7].float()).all(), "row 7 sees the inf"
