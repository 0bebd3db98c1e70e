"""EDGE_CASES.md section X (X1, X4, X5, X9, X10) as tests of the ops and the decode loop.

One section per entry; every test uses fresh random inputs (never zeros), poisons its outputs
first and checks values against an independent reference (tests/reference/*) or an exact
construction. CUDA variants run where a GPU is present (the ``device`` fixture); the heavier
CUDA sweeps are marked ``requires_cuda``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import poison_, requires_cuda
from reference import philox as rph
from reference.paged_attention import assert_fa3_close, paged_attention_ref
from reference.prepare_draft_inputs import prepare_draft_inputs_ref
from tiny_models import make_drafter, make_target

import peagle
from peagle import ops
from peagle.decode import SamplingParams, SpecDecoder
from peagle.models import TargetRunner
from peagle.ops import VerifyOutput
from peagle.testing import make_batch

# as tests/test_paged_attention.py
CUDA_IMPLS = ["auto", "mma", "wgmma", "mma-n32", "wgmma-n32", "wgmma-m64", "wgmma-m128"]


# =============================================================================================
# X1 -- multi-token decode: identical requests must give bit-identical rows at any batch index
# =============================================================================================


def _attn(query, kc, vc, table, qsl, seq, **kw):
    out = poison_(torch.empty_like(query))
    lse = poison_(torch.empty(query.shape[:2], dtype=torch.float32, device=query.device))
    peagle.paged_attention(query, kc, vc, table, qsl, seq, return_lse=True, out=out, lse=lse, **kw)
    return out, lse


def identical_batch(gen, copies, q_len, kv_len, hq, hkv, d, block_size, dtype, device):
    """``copies`` requests with the same Q and the same K/V content, each in its own physical
    pages (a random permutation), and one different neighbour request at batch index 1 (other
    q_len and kv_len). Pages nobody owns and cache slots past each kv_len hold NaN.

    Returns ``(args, idx, single)``: the op's positional inputs, the batch indices of the copies,
    and the inputs of the copy alone (for the fp64 reference)."""
    n_q, n_kv = q_len + 3, kv_len // 2 + 7  # the neighbour
    q_lens = [q_len, n_q] + [q_len] * (copies - 1)
    kv_lens = [kv_len, n_kv] + [kv_len] * (copies - 1)
    idx = [0] + list(range(2, copies + 1))
    need = [-(-kv // block_size) for kv in kv_lens]
    width = max(need) + 1
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    kc = torch.full((num_blocks, block_size, hkv, d), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    table = torch.full((len(q_lens), width), -1, dtype=torch.int32)
    k_a = torch.randn(kv_len, hkv, d, generator=gen)
    v_a = torch.randn(kv_len, hkv, d, generator=gen)
    q_a = torch.randn(q_len, hq, d, generator=gen)
    nxt = 0
    for r, (kv, n) in enumerate(zip(kv_lens, need, strict=True)):
        blocks = perm[nxt : nxt + n]
        nxt += n
        table[r, :n] = blocks.to(torch.int32)
        kk = k_a if r != 1 else torch.randn(kv, hkv, d, generator=gen)
        vv = v_a if r != 1 else torch.randn(kv, hkv, d, generator=gen)
        for j in range(n):
            lo, hi = j * block_size, min(kv, (j + 1) * block_size)
            kc[blocks[j], : hi - lo] = kk[lo:hi]
            vc[blocks[j], : hi - lo] = vv[lo:hi]
    query = torch.cat([q_a, torch.randn(n_q, hq, d, generator=gen)] + [q_a] * (copies - 1))
    qsl = torch.tensor([0] + np.cumsum(q_lens).tolist(), dtype=torch.int32)
    i32 = {"dtype": torch.int32, "device": device}
    kc, vc = kc.to(dtype=dtype, device=device), vc.to(dtype=dtype, device=device)
    args = (
        query.to(dtype=dtype, device=device), kc, vc, table.to(device), qsl.to(device),
        torch.tensor(kv_lens, **i32),
    )  # fmt: skip
    single = (
        q_a.to(dtype), kc.cpu(), vc.cpu(), table[:1], torch.tensor([0, q_len], dtype=torch.int32),
        torch.tensor([kv_len], dtype=torch.int32),
    )  # fmt: skip
    return args, idx, single


def _check_identical(args, idx, single, ref, ref_lse, ref_pt, what, **kw):
    qsl = args[4].tolist()
    out, lse = _attn(*args, **kw)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"{what}: NaN"
    first = slice(qsl[idx[0]], qsl[idx[0] + 1])
    for r in idx[1:]:
        rows = slice(qsl[r], qsl[r + 1])
        assert torch.equal(out[rows], out[first]), f"{what}: request {r} differs from request 0"
        assert torch.equal(lse[rows], lse[first]), f"{what}: lse of request {r} differs"
    assert_fa3_close(out[first], ref, ref_pt, what=what)
    torch.testing.assert_close(lse[first].cpu().double(), ref_lse, rtol=0, atol=2e-4)


X1_HEADS = [(32, 8, 128), (64, 8, 64), (8, 8, 64)]


@pytest.mark.parametrize("heads", X1_HEADS, ids=lambda h: "x".join(map(str, h)))
@pytest.mark.parametrize("q_len", [2, 5, 16])
def test_x1_identical_requests_give_identical_rows(device, gen, heads, q_len):
    """X1: B = 4 requests, three of them identical (Q and K/V content, different pages) around a
    different neighbour: every copy's rows are bit-identical, with the automatic and an explicit
    split count, and equal the per-request fp64 reference (bottom-right causal mask)."""
    hq, hkv, d = heads
    kv_len = 3000 if device == "cuda" else 700
    args, idx, single = identical_batch(
        gen, 3, q_len, kv_len, hq, hkv, d, 16, torch.bfloat16, device
    )
    ref, ref_lse = paged_attention_ref(*single)
    ref_pt, _ = paged_attention_ref(*single, compute_dtype=torch.bfloat16)
    for ns in (0, 3):
        _check_identical(args, idx, single, ref, ref_lse, ref_pt, f"num_splits={ns}",
                         num_splits=ns, max_query_len=q_len + 3)  # fmt: skip


@requires_cuda
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", X1_HEADS, ids=lambda h: "x".join(map(str, h)))
@pytest.mark.parametrize("q_len", list(range(2, 17)))
def test_x1_cuda_sweep_identical_requests_every_qlen_and_kernel(gen, heads, q_len, dtype,
                                                                monkeypatch):  # fmt: skip
    """X1 on the GPU: q_len 2..16, every kernel variant, split-KV on (kv 4100, auto / 3 / 7
    splits) and off (1 split): identical requests bit-identical, close to the fp64 reference."""
    hq, hkv, d = heads
    args, idx, single = identical_batch(gen, 3, q_len, 4100, hq, hkv, d, 16, dtype, "cuda")
    ref, ref_lse = paged_attention_ref(*single)
    ref_pt, _ = paged_attention_ref(*single, compute_dtype=dtype)
    for impl in CUDA_IMPLS:
        if impl == "auto":
            monkeypatch.delenv("PEAGLE_ATTN_IMPL", raising=False)
        else:
            monkeypatch.setenv("PEAGLE_ATTN_IMPL", impl)
        for ns in (0, 1, 3, 7):
            _check_identical(args, idx, single, ref, ref_lse, ref_pt, f"{impl} num_splits={ns}",
                             num_splits=ns, max_query_len=q_len + 3)  # fmt: skip


# =============================================================================================
# X4 -- masked-softmax sentinels: very negative valid scores, fully masked rows, empty splits
# =============================================================================================

X4_SCALE = 65.5
X4_Q0 = 2.0**-10  # q = [2^-10, 1, 1, ...]; key A = -16 everywhere, key B = A with k[0] = 0


def very_negative_problem(gen, dtype, device, hq=8, hkv=2, d=64, block_size=16):
    """Requests over keys whose scaled scores are about -6.6e4 (exact in fp32):
    key A: -16 * (63 + 2^-10) * 65.5 = -66025.0234375, key B: -16 * 63 * 65.5 = -66024.

    Requests (q_len, kv_len): r0 (1, 2) sees A and B; r1 (2, 2): row 0 sees A only, row 1 both;
    r2 (4, 2): rows 0-1 see nothing (q_len > kv_len), rows 2-3 as r1; r3 (3, 0): no key at all.
    Global rows: r0 0; r1 1-2; r2 3-6; r3 7-9.
    V is random per request; every other cache slot (the rest of each page, unused pages) is NaN.
    Returns the op's inputs, the fp64 weights per visible key and V per request."""
    q_lens, kv_lens = [1, 2, 4, 3], [2, 2, 2, 0]
    num_blocks = 6
    perm = torch.randperm(num_blocks, generator=gen)
    kc = torch.full((num_blocks, block_size, hkv, d), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    table = torch.full((4, 2), -1, dtype=torch.int32)
    key_a = torch.full((hkv, d), -16.0)
    key_b = key_a.clone()
    key_b[:, 0] = 0.0
    values = []
    for r in range(3):
        blk = int(perm[r])
        table[r, 0] = blk
        kc[blk, 0], kc[blk, 1] = key_a, key_b
        v = torch.randn(2, hkv, d, generator=gen)
        vc[blk, :2] = v
        values.append(v.to(dtype).double())
    query = torch.ones(sum(q_lens), hq, d)
    query[:, :, 0] = X4_Q0
    i32 = {"dtype": torch.int32, "device": device}
    args = (
        query.to(dtype=dtype, device=device), kc.to(dtype=dtype, device=device),
        vc.to(dtype=dtype, device=device), table.to(device),
        torch.tensor([0, 1, 3, 7, 10], **i32), torch.tensor(kv_lens, **i32),
    )  # fmt: skip
    s_a = -16.0 * (63 + X4_Q0) * X4_SCALE
    s_b = -16.0 * 63 * X4_SCALE
    return args, values, (s_a, s_b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_x4_two_very_negative_keys_give_exact_softmax_mean(device, gen, dtype):
    """X4: two valid keys with scaled scores ~ -6.6e4 give softmax([s_A, s_B]) @ V (weights 0.26 /
    0.74: a row zeroed by a finite -5e4 sentinel, or taken over by masked NaN slots, fails)."""
    args, values, (s_a, s_b) = very_negative_problem(gen, dtype, device)
    out, lse = _attn(*args, softmax_scale=X4_SCALE)
    w = torch.softmax(torch.tensor([s_a, s_b], dtype=torch.float64), 0)
    lse_ab = float(torch.logsumexp(torch.tensor([s_a, s_b], dtype=torch.float64), 0))
    hq, hkv = args[0].shape[1], args[1].shape[2]
    for r, row in ((0, 0), (1, 2), (2, 6)):  # rows that see both keys
        v = values[r].repeat_interleave(hq // hkv, dim=1)  # [2, Hq, D]
        want = w[0] * v[0] + w[1] * v[1]
        assert (want - v[1]).abs().max() > 0.1  # both keys matter
        torch.testing.assert_close(out[row].cpu().double(), want, rtol=1e-2, atol=1.5e-2)
        torch.testing.assert_close(
            lse[row].cpu().double(), torch.full((hq,), lse_ab, dtype=torch.float64),
            rtol=0, atol=0.05,
        )  # fmt: skip
    # The fp64 reference agrees on every row (same inputs, NaN slots and all).
    ref, ref_lse = paged_attention_ref(*args, softmax_scale=X4_SCALE)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-2, atol=1.5e-2)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=0, atol=0.05)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_x4_one_valid_key_gives_its_value(device, gen, dtype):
    """X4: a row whose only visible key scores ~ -6.6e4 returns that key's V (weight exactly 1)
    and lse = its score."""
    args, values, (s_a, _) = very_negative_problem(gen, dtype, device)
    out, lse = _attn(*args, softmax_scale=X4_SCALE)
    hq, hkv = args[0].shape[1], args[1].shape[2]
    for r, row in ((1, 1), (2, 5)):  # row 0 of r1 and row 2 of r2 see key A only
        want = values[r][0].repeat_interleave(hq // hkv, dim=0)
        if device == "cpu":
            assert torch.equal(out[row].double(), want)
        else:
            torch.testing.assert_close(out[row].cpu().double(), want, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(
            lse[row].cpu().double(), torch.full((hq,), s_a, dtype=torch.float64), rtol=0, atol=0.05
        )


def test_x4_fully_masked_rows_give_zero_and_minus_inf_lse(device, gen):
    """X4: rows with no visible key (q_len > kv_len, kv_len = 0) give output 0 and lse -inf, never
    NaN, next to very negative valid rows and NaN padding slots."""
    args, _, _ = very_negative_problem(gen, torch.bfloat16, device)
    out, lse = _attn(*args, softmax_scale=X4_SCALE)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    empty = [3, 4, 7, 8, 9]  # r2 rows 0-1 and r3's three rows
    assert torch.all(out[empty] == 0) and torch.all(torch.isneginf(lse[empty]))
    assert torch.all(torch.isfinite(lse[[0, 1, 2, 5, 6]]))


def _window_problem(gen, q_len, kv_len, window_left, hq, hkv, d, block_size, device):
    """One K-query decode request over a long context; returns the op inputs with finite data and
    a copy whose invisible keys (before the first row's window, past kv_len) are NaN."""
    need = -(-kv_len // block_size)
    num_blocks = need + 2
    perm = torch.randperm(num_blocks, generator=gen)
    kc = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    vc = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    table = torch.full((1, need + 1), -1, dtype=torch.int32)
    table[0, :need] = perm[:need].to(torch.int32)
    query = torch.randn(q_len, hq, d, generator=gen)
    nan_k, nan_v = kc.clone(), vc.clone()
    first_visible = max(0, kv_len - q_len - window_left)
    for key in list(range(first_visible)) + list(range(kv_len, need * block_size)):
        blk, off = int(table[0, key // block_size]), key % block_size
        nan_k[blk, off] = float("nan")
        nan_v[blk, off] = float("nan")
    for blk in perm[need:]:
        nan_k[blk] = float("nan")
        nan_v[blk] = float("nan")
    i32 = {"dtype": torch.int32, "device": device}
    meta = (table.to(device), torch.tensor([0, q_len], **i32), torch.tensor([kv_len], **i32))
    bf = lambda x: x.to(dtype=torch.bfloat16, device=device)
    clean = (bf(query), bf(kc), bf(vc)) + meta
    poisoned = (bf(query), bf(nan_k), bf(nan_v)) + meta
    return clean, poisoned


@pytest.mark.parametrize("num_splits", [0, 3, 8, 16, 64])
def test_x4_split_without_visible_key_and_nan_padding_keys(device, gen, num_splits):
    """X4: an 8-query decode over 1000 keys with a 30-key window: only the last tile holds visible
    keys, so with several splits most splits own no visible key (their partials must merge as
    empty, not as NaN); every invisible key and padding slot holds NaN. Output = the fp64
    reference on the clean cache, no NaN."""
    clean, poisoned = _window_problem(gen, 8, 1000, 30, 32, 8, 64, 16, device)
    ref, ref_lse = paged_attention_ref(*clean, window_left=30)
    ref_pt, _ = paged_attention_ref(*clean, window_left=30, compute_dtype=torch.bfloat16)
    out, lse = _attn(*poisoned, window_left=30, num_splits=num_splits, max_query_len=8)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_fa3_close(out, ref, ref_pt, what=f"num_splits={num_splits}")
    torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=0, atol=2e-4)


def test_x4_nan_padding_keys_never_leak(device, gen):
    """X4: NaN in every cache slot no row may see (slots past kv_len in the last page, pages of no
    request) with causal rows q_len > kv_len next to long rows: matches the reference."""
    clean, poisoned = _window_problem(gen, 14, 9, 10**6, 16, 4, 64, 16, device)
    ref, ref_lse = paged_attention_ref(*clean)
    ref_pt, _ = paged_attention_ref(*clean, compute_dtype=torch.bfloat16)
    for ns in (0, 1, 2):
        out, lse = _attn(*poisoned, num_splits=ns)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        assert_fa3_close(out, ref, ref_pt)
        torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=0, atol=2e-4)


# =============================================================================================
# X5 -- draft noise vs verification noise: disjoint streams, output distribution = p
# =============================================================================================
#
# How peagle draws its randomness (python/peagle/decode/engine.py, kernels/philox.h):
# * the decode loop drafts by argmax (``Eagle3Drafter.greedy_draft``): no draft noise at all, and
#   verification runs with ``draft_probs=None`` (one-hot q);
# * verify_chain draws Philox4x32-10 with key = the request's seed and counter = (offset, index,
#   stream): stream 0 = acceptance (index = draft position), 1 = recovered token, 2 = bonus token;
#   the loop advances each request's offset by 1 per step, so no (seed, offset) pair repeats.
# A caller that samples drafts itself must use noise outside these streams (here: stream 3) --
# the control test below shows what reusing the acceptance draw (the X5 bug) does.

X5_V = 8
X5_DRAFT_STREAM = 3  # not one of verify_chain's streams 0-2


def _philox_u(seeds: np.ndarray, offset: int, index: int, stream: int) -> np.ndarray:
    """verify_chain's uniform formula for many seeds at once (tests/reference/philox.py)."""
    s = seeds.astype(np.uint64)
    w0, w1, _, _ = rph.philox4x32_10(
        (offset & 0xFFFFFFFF, offset >> 32, index, stream),
        (s & np.uint64(0xFFFFFFFF), s >> np.uint64(32)),
    )
    a = (w0 >> np.uint64(5)).astype(np.float64)
    b = (w1 >> np.uint64(6)).astype(np.float64)
    return (a * 67108864.0 + b) / 9007199254740992.0


def _inverse_cdf(q: torch.Tensor, u: np.ndarray) -> torch.Tensor:
    cdf = torch.cumsum(q.double(), 0)
    idx = torch.searchsorted(cdf, torch.from_numpy(u), right=True)
    return torch.clamp(idx, max=q.shape[0] - 1).to(torch.int32)


def _x5_problem(seed=5):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, X5_V, generator=g) * 1.5  # the draft row, then the bonus row
    q = torch.softmax(torch.randn(X5_V, generator=g) * 1.5, 0)
    p = torch.softmax(logits[0].double(), 0)
    assert (p - q.double()).abs().sum() > 0.5  # q != p
    return logits, q, p


def _x5_verify(device, logits, drafts, seeds, offset, q=None):
    """B = len(drafts) independent requests, K = 1 draft each, T = 1: the emitted tokens."""
    n = drafts.shape[0]
    out = VerifyOutput(
        poison_(torch.empty(n, 2, dtype=torch.int32, device=device)),
        poison_(torch.empty(n, dtype=torch.int32, device=device)),
        None,
    )
    ops.verify_chain(
        logits.repeat(n, 1).to(device),
        drafts.to(device),
        torch.arange(1, n + 1, dtype=torch.int32, device=device),
        torch.ones(n, device=device),
        torch.from_numpy(seeds.astype(np.int64)).to(device),
        torch.full((n,), offset, dtype=torch.int64, device=device),
        draft_probs=None if q is None else q.expand(n, X5_V).contiguous().to(device),
        out=out,
    )
    return out.output_token_ids.cpu(), out.num_accepted.cpu()


def _chi2_pvalue(tokens: torch.Tensor, p: torch.Tensor) -> float:
    from scipy.stats import chisquare

    counts = torch.bincount(tokens.long(), minlength=X5_V).double()
    p = p.double() / p.double().sum()
    return float(chisquare(counts.numpy(), (p * counts.sum()).numpy()).pvalue)


def _x5_trials(device) -> int:
    return 100_000 if device == "cuda" else 24_000


def test_x5_argmax_drafts_first_token_follows_p(device):
    """X5, the decode loop's scheme: drafts are the drafter's argmax (q one-hot, no draft noise),
    one seed per request: the first emitted token is distributed as p (chi-square)."""
    logits, q, p = _x5_problem()
    n = _x5_trials(device)
    seeds = np.arange(n, dtype=np.int64) * 7919 + 17
    drafts = torch.full((n,), int(torch.argmax(q)), dtype=torch.int32)
    tokens, acc = _x5_verify(device, logits, drafts, seeds, offset=3)
    assert ((tokens[:, 0] >= 0) & (tokens[:, 0] < X5_V)).all()
    assert 0 < int(acc.sum()) < n
    assert _chi2_pvalue(tokens[:, 0], p) > 1e-3


def test_x5_drafts_sampled_from_q_first_token_follows_p(device):
    """X5: drafts sampled from q != p with noise keyed by the request's (seed, offset) on a stream
    verify_chain does not use; with draft_probs = q the first emitted token follows p."""
    logits, q, p = _x5_problem()
    n = _x5_trials(device)
    seeds = np.arange(n, dtype=np.int64) * 104729 + 5
    offset = 11
    drafts = _inverse_cdf(q, _philox_u(seeds, offset, 0, X5_DRAFT_STREAM))
    assert _chi2_pvalue(drafts, q.double()) > 1e-3  # the drafts really are q-distributed
    tokens, acc = _x5_verify(device, logits, drafts, seeds, offset, q=q)
    assert 0 < int(acc.sum()) < n
    assert _chi2_pvalue(tokens[:, 0], p) > 1e-3


def test_x5_control_reused_acceptance_noise_is_detected(device):
    """Control for the two tests above (their chi-square can fail): drafts drawn with the
    verifier's own acceptance uniform (stream 0, index 0: the X5 bug) bias the output."""
    logits, q, p = _x5_problem()
    n = _x5_trials(device)
    seeds = np.arange(n, dtype=np.int64) * 104729 + 5
    offset = 11
    drafts = _inverse_cdf(q, _philox_u(seeds, offset, 0, rph.STREAM_ACCEPT))
    tokens, _ = _x5_verify(device, logits, drafts, seeds, offset, q=q)
    assert _chi2_pvalue(tokens[:, 0], p) < 1e-6


def test_x5_seeded_request_ignores_batch_neighbours_op(device):
    """X5 / A9 at the op: a seeded random request's output depends only on its seed and offset,
    not on its batch position or on neighbours (other K, greedy, other logits, padding)."""
    logits, q, _ = _x5_problem()
    n = 64
    seeds = np.arange(n, dtype=np.int64) * 31 + 1
    drafts = _inverse_cdf(q, _philox_u(seeds, 2, 0, X5_DRAFT_STREAM))
    alone, acc_alone = _x5_verify(device, logits, drafts, seeds, 2, q=q)
    # The same requests, reversed, each followed by a neighbour with 3 drafts and other logits.
    g = torch.Generator().manual_seed(6)
    rows, dr, cu, temps, sd, qs, real = [], [], [], [], [], [], []
    total = 0
    for i in reversed(range(n)):
        rows += [logits]
        dr.append(int(drafts[i]))
        qs.append(q.view(1, -1))
        total += 1
        cu.append(total)
        temps.append(1.0)
        sd.append(int(seeds[i]))
        real.append(True)
        k = 3
        rows.append(torch.randn(k + 1, X5_V, generator=g) * 3)
        dr += torch.randint(0, X5_V, (k,), generator=g).tolist()
        qs.append(torch.softmax(torch.randn(k, X5_V, generator=g), 1))
        total += k
        cu.append(total)
        temps.append([0.0, 0.7][i % 2])
        sd.append(int(seeds[(i + 1) % n]))
        real.append(i % 5 != 0)  # some neighbours are padding requests
    b = len(cu)
    out = VerifyOutput(
        poison_(torch.empty(b, 4, dtype=torch.int32, device=device)),
        poison_(torch.empty(b, dtype=torch.int32, device=device)),
        None,
    )
    ops.verify_chain(
        torch.cat(rows).to(device),
        torch.tensor(dr, dtype=torch.int32, device=device),
        torch.tensor(cu, dtype=torch.int32, device=device),
        torch.tensor(temps, device=device),
        torch.tensor(sd, dtype=torch.int64, device=device),
        torch.full((b,), 2, dtype=torch.int64, device=device),
        draft_probs=torch.cat(qs).to(device),
        request_mask=torch.tensor(real, device=device),
        out=out,
    )
    mixed = out.output_token_ids.cpu()[0::2, :2].flip(0)
    assert torch.equal(mixed, alone)
    assert torch.equal(out.num_accepted.cpu()[0::2].flip(0), acc_alone)


# ---- X5 through the decode loop (CPU float32 tiny models: bit-exact across batch shapes) ------


@pytest.fixture(scope="module")
def tiny():
    model, g = make_target("llama")
    return model, g, TargetRunner(model)


def _engine(tiny, k=3, cls=None, **kw):
    model, g, runner = tiny
    kw.setdefault("block_size", 4)
    return (cls or SpecDecoder)(
        runner, make_drafter(model, g), method="peagle", num_speculative_tokens=k, **kw
    )


@pytest.mark.parametrize("cuda_graphs", ["off", "emulate"])
def test_x5_decode_loop_seeded_request_ignores_neighbours(tiny, cuda_graphs):
    """X5: a seeded T = 1 request gives the same tokens alone, with other neighbours (seeded,
    unseeded, greedy, other K) and at another batch index; the engine never reuses a (seed,
    offset) pair of a request (so acceptance / recovered / bonus draws never repeat)."""
    mine = SamplingParams(max_new_tokens=14, temperature=1.0, seed=4242)
    prompt = [42, 17, 8, 90, 33]
    eng = _engine(tiny, cuda_graphs=cuda_graphs, max_num_seqs=4)
    pairs: list[tuple[int, int]] = []
    real_verify = ops.verify_chain

    def spy(logits, drafts, cu, temp, seeds, offsets, **kw):
        mask = kw.get("request_mask")
        live = [i for i in range(seeds.shape[0]) if mask is None or bool(mask[i])]
        for i in live:
            if int(seeds[i]) == mine.seed:
                pairs.append((int(seeds[i]), int(offsets[i])))
        return real_verify(logits, drafts, cu, temp, seeds, offsets, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(ops, "verify_chain", spy)
    try:
        alone = eng.generate([prompt], mine)[0].token_ids
        assert len(pairs) == len(set(pairs)) > 3
        neighbour_sets = [
            [([5], SamplingParams(max_new_tokens=9, temperature=1.0, seed=7)),
             ([9, 9, 4], SamplingParams(max_new_tokens=20, temperature=0.8))],
            [([11, 3, 60], SamplingParams(max_new_tokens=5)),
             ([2, 13], SamplingParams(max_new_tokens=16, temperature=1.0, seed=4243,
                                      num_speculative_tokens=1)),
             ([70, 1, 1, 6], SamplingParams(max_new_tokens=3, temperature=1.3, top_k=5))],
        ]  # fmt: skip
        for neighbours in neighbour_sets:
            for pos in (0, len(neighbours)):
                batch = neighbours[:pos] + [(prompt, mine)] + neighbours[pos:]
                pairs.clear()
                outs = eng.generate([b[0] for b in batch], [b[1] for b in batch])
                assert outs[pos].token_ids == alone, (pos, neighbours)
                assert len(pairs) == len(set(pairs))
    finally:
        mp.undo()
    assert eng.allocator.num_allocated == 0


# =============================================================================================
# X9 -- an EOS accepted inside the block stops there; statistics count emitted tokens only
# =============================================================================================

X9_PROMPT = [11, 3, 60]  # its greedy continuation starts with 9 distinct tokens


class OracleDecoder(SpecDecoder):
    """Drafts = the target's greedy continuation (from transformers), so every draft is accepted
    and a whole block [d_1 .. d_K, bonus] would be committed."""

    continuation: list[int] = []

    def _propose(self, batch, out_tokens, aux, drafting):
        super()._propose(batch, out_tokens, aux, drafting)
        drafts = self._last_drafts.clone()
        k = self.num_spec_tokens
        for i, r in enumerate(batch.reqs):
            if drafting[i]:
                n = len(r.output_token_ids)
                nxt = (self.continuation[n : n + k] + [0] * k)[:k]
                drafts[i] = torch.tensor(nxt, dtype=drafts.dtype)
        self._last_drafts = drafts


@pytest.fixture(scope="module")
def x9_ref(tiny):
    from test_decode import hf_greedy  # margins checked: the target's argmax is unambiguous

    ref = hf_greedy(tiny[0], X9_PROMPT, 30)
    assert len(set(ref[:9])) == 9
    return ref


def _oracle(tiny, ref, k, **kw):
    eng = _engine(tiny, k, cls=OracleDecoder, **kw)
    eng.continuation = ref
    return eng


def _check_stats(out, k, emitted_in_block):
    """Prefill step (no drafts) + one speculative step of k drafts, of which only
    ``emitted_in_block`` were emitted before the stop."""
    st = out.stats
    assert st.num_steps == 2 and st.num_spec_steps == 1
    assert st.num_draft_tokens == k
    assert st.num_accepted_tokens == emitted_in_block
    assert st.acceptance_length == 1.0 + emitted_in_block
    assert st.per_position_acceptance == [1.0] * emitted_in_block + [0.0] * (k - emitted_in_block)
    assert st.num_generated_tokens == len(out.token_ids)


@pytest.mark.parametrize("cuda_graphs", ["off", "emulate"])
def test_x9_eos_inside_accepted_block_stops_there(tiny, x9_ref, cuda_graphs):
    """X9: drafts [a, EOS, b] all equal to the target's argmax (the round would commit
    [a, EOS, b, bonus]): the output ends at [a, EOS], finish reason "stop", nothing after EOS is
    returned (on_finish sees the same), statistics count the 2 emitted drafts, not 3."""
    ref = x9_ref
    eos = ref[2]  # block of step 1: drafts ref[1], ref[2], ref[3], bonus ref[4]
    eng = _oracle(tiny, ref, 3, eos_token_ids=[eos], cuda_graphs=cuda_graphs)
    seen = []
    out = eng.generate([X9_PROMPT], SamplingParams(max_new_tokens=20), on_finish=seen.append)[0]
    assert out.token_ids == ref[:3] and out.token_ids[-1] == eos
    assert out.finish_reason == "stop"
    assert seen[0].token_ids == ref[:3]
    _check_stats(out, 3, 2)
    assert not eng.running and eng.allocator.num_allocated == 0


@pytest.mark.parametrize("j", range(8))
def test_x9_eos_at_every_position_of_a_k7_block(tiny, x9_ref, j):
    """X9: EOS at draft position j of a fully accepted K = 7 block (j = 7: the bonus token): the
    output is the prefix up to EOS, accepted statistics = drafts emitted (min(j + 1, 7))."""
    ref = x9_ref
    eos = ref[1 + j]
    eng = _oracle(tiny, ref, 7, eos_token_ids=[eos])
    out = eng.generate([X9_PROMPT], SamplingParams(max_new_tokens=25))[0]
    assert out.token_ids == ref[: 2 + j] and out.finish_reason == "stop"
    _check_stats(out, 7, min(j + 1, 7))


def test_x9_stop_token_id_list(tiny, x9_ref):
    """X9: a stop id list: the first listed id emitted ends the request (here the later-listed
    one comes first in the block); ignore_eos drops only the engine's EOS ids."""
    ref = x9_ref
    eng = _oracle(tiny, ref, 7, eos_token_ids=[ref[2]])
    params = SamplingParams(max_new_tokens=25, stop_token_ids=[ref[6], ref[4]], ignore_eos=True)
    out = eng.generate([X9_PROMPT], params)[0]
    assert out.token_ids == ref[:5] and out.finish_reason == "stop"
    _check_stats(out, 7, 4)
    out = eng.generate([X9_PROMPT], SamplingParams(max_new_tokens=25))[0]
    assert out.token_ids == ref[:3] and out.finish_reason == "stop"  # engine EOS ref[2]
    out = eng.generate([X9_PROMPT], SamplingParams(max_new_tokens=17, ignore_eos=True))[0]
    assert out.token_ids == ref[:17] and out.finish_reason == "length"
    assert out.stats.num_accepted_tokens == 14  # 2 full blocks of 7 drafts (17 = 1 + 8 + 8)


# =============================================================================================
# X10 -- graph padding: B_real < B_graph, B_real = 0, B_real = B; padding ids never indices
# =============================================================================================
#
# peagle never derives a "real row count" from the data: a padding request is explicit
# (seq_len 0 for prepare_draft_inputs / paged_attention, request_mask False for verify_chain,
# slot -1 for write_kv_cache). The tests fill every field of the padding requests with sentinels
# (-1 ids, -1 block-table rows, -1 slots, NaN hidden rows / logits / K / V, garbage positions and
# sampling parameters) and check that the real requests are bit-identical to an unpadded run.

X10_B_GRAPH = 4
X10_K = 3


def _pad_draft_batch(batch, b_graph, k):
    """Append graph-padding requests to a draft-step batch: K + 1 rows each in the uniform
    layout, all sentinel values."""
    b = batch.query_start_loc.shape[0] - 1
    n_pad = b_graph - b
    rows = n_pad * (k + 1)
    i32 = torch.int32
    batch.target_token_ids = torch.cat([batch.target_token_ids, torch.full((rows,), -1, dtype=i32)])
    batch.target_positions = torch.cat(
        [batch.target_positions, torch.full((rows,), 2**40, dtype=torch.int64)]
    )
    last = int(batch.query_start_loc[-1])
    extra = last + (k + 1) * torch.arange(1, n_pad + 1, dtype=i32)
    batch.query_start_loc = torch.cat([batch.query_start_loc, extra])
    batch.seq_lens = torch.cat([batch.seq_lens, torch.zeros(n_pad, dtype=i32)])
    batch.sampled_token_ids = torch.cat(
        [batch.sampled_token_ids, torch.full((n_pad, k + 1), -1, dtype=i32)]
    )
    batch.discard_request_mask = torch.cat(
        [batch.discard_request_mask, torch.zeros(n_pad, dtype=torch.bool)]
    )
    batch.backup_next_token_ids = torch.cat(
        [batch.backup_next_token_ids, torch.full((n_pad,), -1, dtype=i32)]
    )
    cu_last = int(batch.cu_num_draft_tokens[-1]) if b else 0
    batch.cu_num_draft_tokens = torch.cat(
        [batch.cu_num_draft_tokens, cu_last + k * torch.arange(1, n_pad + 1, dtype=i32)]
    )
    width = batch.block_table.shape[1]
    batch.block_table = torch.cat([batch.block_table, torch.full((n_pad, width), -1, dtype=i32)])
    if batch.target_hidden_states is not None:
        h = batch.target_hidden_states
        batch.target_hidden_states = torch.cat([h, torch.full((rows, h.shape[1]), float("nan"))])
    return batch


def _real_batch(b_real, k, seed):
    """b_real random decode requests (0..K rejected drafts); b_real = 0: the empty batch."""
    gen = torch.Generator().manual_seed(seed)
    if b_real:
        return make_batch(gen, b_real, k, padding_frac=0.0, prefill_frac=0.0)
    base = make_batch(gen, 1, k, padding_frac=0.0, prefill_frac=0.0)
    base.query_start_loc = base.query_start_loc[:1]
    for name in ("target_token_ids", "target_positions", "target_hidden_states", "seq_lens",
                 "sampled_token_ids", "discard_request_mask", "backup_next_token_ids",
                 "cu_num_draft_tokens", "block_table"):  # fmt: skip
        setattr(base, name, getattr(base, name)[:0])
    return base


def _prep(batch, device):
    from test_prepare_draft_inputs import run_op as prep_run

    return prep_run(batch, device)


@pytest.mark.parametrize("b_real", [0, 1, 3, 4])
def test_x10_prepare_draft_inputs_graph_padding(device, b_real):
    """X10 / META: B_real real requests padded to B_graph = 4 (B_real = 4: no padding, 0: all
    padding): real outputs are bit-identical to the unpadded run, padding rows are inert (id 0,
    position 0, slot -1, rejected, not masked; sample indices at their own first row; seq_len 0),
    sentinel ids / positions / NaN hidden rows of padding requests never reach a real row."""
    from test_prepare_draft_inputs import assert_matches_ref

    real = _real_batch(b_real, X10_K, 100 + b_real)
    want = _prep(real, device) if b_real else None
    padded = _pad_draft_batch(_real_batch(b_real, X10_K, 100 + b_real), X10_B_GRAPH, X10_K)
    got = _prep(padded, device)
    assert_matches_ref(got, prepare_draft_inputs_ref(*padded.positional(), **padded.kwargs()))
    n = X10_K - 1
    t_real = int(real.query_start_loc[-1]) + b_real * n
    if want is not None:
        for name in ("input_ids", "positions", "is_rejected", "is_masked", "slot_mapping"):
            assert torch.equal(getattr(got, name)[:t_real], getattr(want, name)), name
        for name in ("token_indices_to_sample", "seq_lens", "next_token_ids",
                     "valid_sampled_tokens_count"):  # fmt: skip
            g = getattr(got, name)[: getattr(want, name).shape[0]]
            assert torch.equal(g, getattr(want, name)), name
        assert torch.equal(got.query_start_loc[: b_real + 1], want.query_start_loc)
        h = want.hidden_states
        ref = prepare_draft_inputs_ref(*real.positional(), **real.kwargs())
        d = ref["hidden_defined"]
        assert torch.equal(got.hidden_states[:t_real][d].cpu(), h[d].cpu())
    pad = slice(t_real, got.input_ids.shape[0])
    assert (got.input_ids[pad] == 0).all() and (got.positions[pad] == 0).all()
    assert (got.slot_mapping[pad] == -1).all() and got.is_rejected[pad].all()
    assert not got.is_masked[pad].any()
    assert (got.seq_lens[b_real:] == 0).all() and (
        got.valid_sampled_tokens_count[b_real:] == 0
    ).all()
    qsl = got.query_start_loc.cpu()
    for r in range(b_real, X10_B_GRAPH):
        assert (got.token_indices_to_sample[r * X10_K : (r + 1) * X10_K].cpu() == qsl[r]).all()


def test_x10_prepare_draft_inputs_truly_empty_batch(device):
    """X10: B = 0 (a truly empty batch) is valid: empty outputs, query_start_loc' = [0]."""
    got = _prep(_real_batch(0, X10_K, 7), device)
    assert got.input_ids.numel() == 0 and got.token_indices_to_sample.numel() == 0
    assert got.query_start_loc.tolist() == [0]


@pytest.mark.parametrize("b_real", [0, 2, 4])
def test_x10_write_kv_cache_skips_padding_slots(device, b_real):
    """X10: rows with slot -1 (padding requests, NaN K/V) write nothing; the cache outside the
    real rows' slots is bit-identical to before."""
    gen = torch.Generator().manual_seed(200 + b_real)
    rows_per_req, hkv, d, bs, num_blocks = X10_K + 1, 2, 64, 8, 12
    t = X10_B_GRAPH * rows_per_req
    t_real = b_real * rows_per_req
    slots = torch.full((t,), -1, dtype=torch.int64)
    slots[:t_real] = torch.randperm(num_blocks * bs, generator=gen)[:t_real]
    key = torch.randn(t, hkv, d, generator=gen)
    value = torch.randn(t, hkv, d, generator=gen)
    key[t_real:] = float("nan")
    value[t_real:] = float("nan")
    kc = torch.randn(num_blocks, bs, hkv, d, generator=gen)
    vc = torch.randn(num_blocks, bs, hkv, d, generator=gen)
    want_k, want_v = kc.clone().view(-1, hkv, d), vc.clone().view(-1, hkv, d)
    want_k[slots[:t_real]] = key[:t_real]
    want_v[slots[:t_real]] = value[:t_real]
    kc_d, vc_d = kc.to(device), vc.to(device)
    ops.write_kv_cache(key.to(device), value.to(device), kc_d, vc_d, slots.to(device))
    assert torch.equal(kc_d.cpu().view(-1, hkv, d), want_k)
    assert torch.equal(vc_d.cpu().view(-1, hkv, d), want_v)


@pytest.mark.parametrize("b_real", [0, 2, 4])
def test_x10_verify_chain_ignores_padding_requests(device, b_real):
    """X10 / VER: padding requests (request_mask False) with -1 drafts, NaN logits and garbage
    sampling parameters emit nothing (all -1, 0 accepted); the real requests equal the unpadded
    run and the reference."""
    from test_verify_chain import assert_matches, make_case, reference
    from test_verify_chain import run_op as verify_run

    gen = torch.Generator().manual_seed(300 + b_real)
    counts = [X10_K] * X10_B_GRAPH
    temps = [0.0, 0.8, 1.0, 0.0][:X10_B_GRAPH]
    case = make_case(counts, 50, gen, temps=temps)
    n_pad = X10_B_GRAPH - b_real
    rows_real = b_real * (X10_K + 1)
    case["request_mask"] = torch.tensor([True] * b_real + [False] * n_pad)
    case["target_logits"][rows_real:] = float("nan")
    case["draft_token_ids"][b_real * X10_K :] = -1
    case["temperature"][b_real:] = float("nan")
    case["top_k"] = torch.tensor([0] * b_real + [-3] * n_pad, dtype=torch.int32)
    case["top_p"] = torch.tensor([1.0] * b_real + [7.0] * n_pad)
    got = verify_run(case, device)
    assert_matches(got, reference(case), case)
    assert (got.output_token_ids[b_real:] == -1).all() and (got.num_accepted[b_real:] == 0).all()
    if b_real:
        real = make_case(counts[:b_real], 50, torch.Generator().manual_seed(300 + b_real))
        for name in ("target_logits", "draft_token_ids"):
            real[name] = case[name][: rows_real if name == "target_logits" else b_real * X10_K]
        for name in ("temperature", "seeds", "offsets", "top_k", "top_p"):
            real[name] = case[name][:b_real]
        alone = verify_run(real, device)
        assert torch.equal(alone.output_token_ids, got.output_token_ids[:b_real])
        assert torch.equal(alone.num_accepted, got.num_accepted[:b_real])


@pytest.mark.parametrize("b_real", [0, 1, 3, 4])
def test_x10_paged_attention_padding_requests(device, b_real):
    """X10 / ATTN: drafter-batch layout (2K rows per request) padded to B_graph with seq_len 0
    requests whose query rows are NaN and block-table rows -1: padding rows give 0 / lse -inf,
    the real rows equal the unpadded run bitwise (explicit split count) and the reference."""
    gen = torch.Generator().manual_seed(400 + b_real)
    rows, hq, hkv, d, bs = 2 * X10_K, 8, 2, 64, 16
    kv = torch.randint(rows, 300, (X10_B_GRAPH,), generator=gen).tolist()
    kv_lens = kv[:b_real] + [0] * (X10_B_GRAPH - b_real)
    need = [-(-x // bs) for x in kv_lens]
    width = max(need + [1]) + 1
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((X10_B_GRAPH, width), -1, dtype=torch.int32)
    nxt = 0
    for r, n in enumerate(need):
        table[r, :n] = perm[nxt : nxt + n].to(torch.int32)
        nxt += n
    bf = lambda x: x.to(dtype=torch.bfloat16, device=device)
    kc = bf(torch.randn(num_blocks, bs, hkv, d, generator=gen))
    vc = bf(torch.randn(num_blocks, bs, hkv, d, generator=gen))
    query = torch.randn(X10_B_GRAPH * rows, hq, d, generator=gen)
    query[b_real * rows :] = float("nan")
    i32 = {"dtype": torch.int32, "device": device}
    qsl = torch.arange(X10_B_GRAPH + 1, **i32) * rows
    args = (bf(query), kc, vc, table.to(device), qsl, torch.tensor(kv_lens, **i32))
    out, lse = _attn(*args, num_splits=2, max_query_len=rows)
    t_real = b_real * rows
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[t_real:] == 0).all() and torch.isneginf(lse[t_real:]).all()
    if b_real:
        alone = (args[0][:t_real], kc, vc, args[3][:b_real], qsl[: b_real + 1], args[5][:b_real])
        out1, lse1 = _attn(*alone, num_splits=2, max_query_len=rows)
        assert torch.equal(out1, out[:t_real]) and torch.equal(lse1, lse[:t_real])
        ref, _ = paged_attention_ref(*alone)
        ref_pt, _ = paged_attention_ref(*alone, compute_dtype=torch.bfloat16)
        assert_fa3_close(out1, ref, ref_pt)


# ---- X10 through the decode loop's CUDA-graph layout (run eagerly: cuda_graphs="emulate") -----


@pytest.mark.parametrize("n_real", [1, 3, 4])
def test_x10_decode_loop_graph_padding_never_indexes_with_padding(tiny, n_real, monkeypatch):
    """X10: n_real requests padded to the graph batch (capture sizes 1, 2, 4: n_real 3 runs as 4;
    n_real 1 and 4: B_real = B):
    verify_chain sees exactly n_real True entries of request_mask; no token id outside [0, V)
    reaches the target or the drafter; every KV write lands in a block a live request holds (never
    the null block); the outputs equal the eager (unpadded) loop's."""
    model, g, runner = tiny
    prompts = [[5, 6], [11, 3, 60], [42, 17, 8, 90, 33], [9, 4, 66, 2]][:n_real]
    params = SamplingParams(max_new_tokens=12)
    eager = _engine(tiny, X10_K, max_num_seqs=4).generate(prompts, params)
    eng = _engine(tiny, X10_K, max_num_seqs=4, cuda_graphs="emulate")
    seen = {"graph_steps": 0}
    real_verify, real_write = ops.verify_chain, ops.write_kv_cache

    def verify_spy(logits, drafts, cu, temp, seeds, offsets, **kw):
        mask = kw.get("request_mask")
        if mask is not None:  # the graph layout
            seen["graph_steps"] += 1
            b = len(eng.running)
            assert mask.shape[0] == eng.graphs._pad_size(b) and int(mask.sum()) == b
            assert mask[: len(eng.running)].all()
        return real_verify(logits, drafts, cu, temp, seeds, offsets, **kw)

    def write_spy(key, value, key_cache, value_cache, slot_mapping):
        held = {b for r in eng.running for b in r.blocks}
        blocks = {int(s) // eng.block_size for s in slot_mapping.tolist() if s >= 0}
        assert 0 not in blocks and blocks <= held, blocks - held
        assert (slot_mapping >= -1).all()
        real_write(key, value, key_cache, value_cache, slot_mapping)

    def ids_spy(fn):
        def wrapped(input_ids, *a, **kw):
            assert ((input_ids >= 0) & (input_ids < runner.vocab_size)).all(), input_ids
            return fn(input_ids, *a, **kw)

        return wrapped

    monkeypatch.setattr(ops, "verify_chain", verify_spy)
    monkeypatch.setattr(ops, "write_kv_cache", write_spy)
    monkeypatch.setattr(eng.target, "forward", ids_spy(eng.target.forward))
    monkeypatch.setattr(eng.drafter, "forward", ids_spy(eng.drafter.forward))
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    assert seen["graph_steps"] > 0 and eng.graphs._pad_size(n_real) in eng.graphs.graphs
    assert eng.allocator.num_allocated == 0


def test_x10_decode_loop_all_padding_graph_batch_is_inert(tiny):
    """X10, B_real = 0: the graph step run on a batch of padding requests only (the state graphs
    are captured in) emits nothing (-1, 0 accepted) and leaves both KV caches bit-identical
    (filled with random data first, so any write shows)."""
    eng = _engine(tiny, X10_K, max_num_seqs=4, cuda_graphs="emulate")
    eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6))
    gen = torch.Generator().manual_seed(500)
    for cache in (eng.target_kv, eng.drafter_kv):
        cache.storage.copy_(torch.randn(cache.storage.shape, generator=gen))
    before = [eng.target_kv.storage.clone(), eng.drafter_kv.storage.clone()]
    eng.graphs._get(4)  # fills the static buffers with 4 padding requests
    view = eng.graphs._view(4)
    assert not view.request_mask.any() and (view.seq_lens == 0).all()
    with torch.inference_mode():
        out, acc, aux = eng.target_and_verify_eager(view, X10_K)
        drafts = eng.draft_eager(view, out, aux)
    assert (out == -1).all() and (acc == 0).all()
    assert drafts.shape == (4, X10_K)
    assert torch.equal(eng.target_kv.storage, before[0])
    assert torch.equal(eng.drafter_kv.storage, before[1])
