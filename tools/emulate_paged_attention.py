"""Lane-level numpy emulation of csrc/cuda/paged_attention.cu, for checking the kernel's index
math without a GPU (the CPU CI machine has none).

It mirrors the kernel line by line: the grid (request, KV head x query-tile CTA, split), packed
(row, head) query tiles, tile_keys / split_count, the cp.async stage ring (loads land at issue
time, so a stage overwritten before it is consumed corrupts the result), the XOR-swizzled shared
memory, ldmatrix (.x4, .trans) and mma.sync.m16n8k16 fragment layouts as the PTX ISA defines
them, the exp2-domain online softmax, the epilogue (direct or fp32 partials) and the merge
kernel. bf16 rounding of P and of the output is modelled with torch. Each m16 tile of the packed
query tile is emulated as its own warp (the kernel's warp w owns m16 tiles w*kMT .. w*kMT+kMT-1 and
shares each K/V fragment between them, which changes no value). Slow (pure Python loops over warps
and tiles): use small problems.

    python tools/emulate_paged_attention.py          # random cases vs tests/reference
"""

# ruff: noqa: B023  (load_kv closes over the current tile on purpose, like the kernel lambda)
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from reference.paged_attention import paged_attention_ref  # noqa: E402

BLOCK_N = 64
STAGES = 3
MIN_TILES_PER_SPLIT = 2
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NEG_INF = -math.inf


def bf16_round(x):
    return torch.from_numpy(np.asarray(x, dtype=np.float32)).bfloat16().float().numpy()


# ---- PTX fragment semantics ------------------------------------------------------------------


def swizzle(d, row, chunk):
    return row * (d * 2) + ((chunk ^ (row & 7)) << 4)


def ldmatrix_x4(smem, addrs, trans=False):
    """smem: float32 array indexed by element (byte address / 2); addrs[lane] = row address of
    row lane % 8 of matrix lane // 8. Returns regs[lane, 4, 2] (two b16 values per register)."""
    regs = np.zeros((32, 4, 2), dtype=np.float32)
    for j in range(4):
        mat = np.stack([smem[addrs[8 * j + r] // 2 : addrs[8 * j + r] // 2 + 8] for r in range(8)])
        for lane in range(32):
            g, t = lane // 4, lane % 4
            if trans:
                regs[lane, j] = [mat[2 * t, g], mat[2 * t + 1, g]]
            else:
                regs[lane, j] = mat[g, 2 * t : 2 * t + 2]
    return regs


def mma(d, a, b0, b1):
    """d[lane, 4] += A(16x16 from a[lane,4,2]) @ B(16x8 from b0/b1[lane,2]) in fp32."""
    A = np.zeros((16, 16), dtype=np.float32)
    B = np.zeros((16, 8), dtype=np.float32)
    C = np.zeros((16, 8), dtype=np.float32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for e in range(2):
            A[g, 2 * t + e] = a[lane, 0, e]
            A[g + 8, 2 * t + e] = a[lane, 1, e]
            A[g, 8 + 2 * t + e] = a[lane, 2, e]
            A[g + 8, 8 + 2 * t + e] = a[lane, 3, e]
            B[2 * t + e, g] = b0[lane, e]
            B[8 + 2 * t + e, g] = b1[lane, e]
        C[g, 2 * t : 2 * t + 2] = d[lane, 0:2]
        C[g + 8, 2 * t : 2 * t + 2] = d[lane, 2:4]
    C = C + (A.astype(np.float64) @ B.astype(np.float64)).astype(np.float32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        d[lane, 0:2] = C[g, 2 * t : 2 * t + 2]
        d[lane, 2:4] = C[g + 8, 2 * t : 2 * t + 2]


# ---- shared device logic (mirrors the .cu / kernels header) -----------------------------------


def attn_row_key_lo(kv_len, q_len, i, window_left):
    if window_left < 0:
        return 0
    return max(0, kv_len - q_len + i - window_left)


def tile_keys(kv_len, q_len, p0, p1, group, window_left, cap):
    i_first, i_last = p0 // group, (p1 - 1) // group
    hi_max = min(kv_len - q_len + i_last, cap - 1)
    min_hi = min(kv_len - q_len + i_first, cap - 1)
    lo_min = attn_row_key_lo(kv_len, q_len, i_first, window_left)
    max_lo = attn_row_key_lo(kv_len, q_len, i_last, window_left)
    if hi_max < lo_min:
        kt0, ntk = 0, 0
    else:
        kt0 = lo_min // BLOCK_N
        ntk = hi_max // BLOCK_N - kt0 + 1
    return dict(lo_min=lo_min, hi_max=hi_max, kt0=kt0, ntk=ntk, min_hi=min_hi, max_lo=max_lo)


def split_count(ntk, max_splits, fixed):
    if ntk <= 1:
        return 1
    s = fixed if fixed > 0 else min(max_splits, -(-ntk // MIN_TILES_PER_SPLIT))
    s = max(1, min(s, ntk))
    per = -(-ntk // s)
    return -(-ntk // per)


def plan(b, hq, hkv, max_query_len, num_splits, num_sms=132, per_sm=2):
    group = hq // hkv
    packed = group * max(1, max_query_len)
    block_m = 64 if group <= 4 else 128
    q_tiles = -(-packed // block_m)
    q_tile_ctas = min(q_tiles, 65535 // hkv)
    if num_splits > 0:
        max_splits = num_splits
    else:
        base = b * hkv * q_tile_ctas
        max_splits = max(1, min(64, (num_sms * per_sm) // base if base else 1))
    return block_m, q_tile_ctas, max_splits


# ---- the kernel --------------------------------------------------------------------------------


def emulate(pb, softmax_scale, window_left=-1, sinks=None, max_query_len=-1, num_splits=0, **kw):
    q = pb["query"].float().numpy()
    kc = pb["key_cache"].float().numpy()
    vc = pb["value_cache"].float().numpy()
    table = pb["block_table"].numpy()
    qsl = pb["query_start_loc"].numpy()
    seq = pb["seq_lens"].numpy()
    t_total, hq, d = q.shape
    num_blocks, bs, hkv, _ = kc.shape
    b = len(seq)
    group = hq // hkv
    cap = table.shape[1] * bs
    hint = t_total if max_query_len < 0 or max_query_len > t_total else max_query_len
    block_m, q_tile_ctas, max_splits = plan(b, hq, hkv, hint, num_splits, **kw)
    out = np.full((t_total, hq, d), np.nan, dtype=np.float32)
    lse = np.full((t_total, hq), np.nan, dtype=np.float32)
    ws_out = np.full((max_splits, t_total, hq, d), np.nan, dtype=np.float32)
    ws_lse = np.full((max_splits, t_total, hq), np.nan, dtype=np.float32)
    scale_log2 = np.float32(softmax_scale * LOG2E)
    warps = block_m // 16
    q_bytes = block_m * d * 2
    tile_bytes = BLOCK_N * d * 2

    def request(r):
        qs = min(max(int(qsl[r]), 0), t_total)
        qe = min(max(int(qsl[r + 1]), qs), t_total)
        return qs, qe - qs, max(int(seq[r]), 0)

    # inert rows (block x == B)
    lo = min(max(int(qsl[0]), 0), t_total) if b else 0
    hi = min(max(int(qsl[b]), lo), t_total) if b else 0
    for t in list(range(0, lo)) + list(range(hi, t_total)):
        out[t] = 0
        lse[t] = NEG_INF

    for r in range(b):
        q_start, q_len, kv_len = request(r)
        if q_len == 0:
            continue
        packed_total = q_len * group
        n_qtiles = -(-packed_total // block_m)
        for g in range(hkv):
            for q_cta in range(q_tile_ctas):
                for split in range(max_splits):
                    for q_iter in range(q_cta, n_qtiles, q_tile_ctas):
                        qt = n_qtiles - 1 - q_iter  # heaviest tile first
                        p0 = qt * block_m
                        p1 = min(p0 + block_m, packed_total)
                        tk = tile_keys(kv_len, q_len, p0, p1, group, window_left, cap)
                        n_split = split_count(tk["ntk"], max_splits, num_splits)
                        if split >= n_split:
                            continue
                        per = -(-tk["ntk"] // n_split)
                        kt_begin = tk["kt0"] + split * per
                        n_tiles = max(0, min(tk["kt0"] + tk["ntk"], kt_begin + per) - kt_begin)
                        smem = np.full((q_bytes + 2 * STAGES * tile_bytes) // 2, np.nan, np.float32)
                        s_k = q_bytes
                        s_v = s_k + STAGES * tile_bytes
                        # Q tile (cp.async, zero fill past p1)
                        for m in range(block_m):
                            for ch in range(d // 8):
                                pp = p0 + m
                                dst = swizzle(d, m, ch) // 2
                                if pp < p1:
                                    t = q_start + pp // group
                                    h = g * group + pp % group
                                    smem[dst : dst + 8] = q[t, h, ch * 8 : ch * 8 + 8]
                                else:
                                    smem[dst : dst + 8] = 0

                        def load_kv(kt, stage):
                            for row in range(BLOCK_N):
                                key = kt * BLOCK_N + row
                                ok = tk["lo_min"] <= key <= tk["hi_max"]
                                blk = int(table[r, key // bs]) if ok else -1
                                ok = 0 <= blk < num_blocks
                                for ch in range(d // 8):
                                    dst = (stage * tile_bytes + swizzle(d, row, ch)) // 2
                                    for base, cache in ((s_k, kc), (s_v, vc)):
                                        o = base // 2 + dst
                                        if ok:
                                            smem[o : o + 8] = cache[
                                                blk, key % bs, g, ch * 8 : ch * 8 + 8
                                            ]
                                        else:
                                            smem[o : o + 8] = 0

                        for st in range(STAGES - 1):
                            if st < n_tiles:
                                load_kv(kt_begin + st, st)
                        for warp in range(warps):
                            warp_active = p0 + warp * 16 < p1
                            rows_lo = np.zeros((32, 2), np.int64)
                            rows_hi = np.zeros((32, 2), np.int64)
                            for lane in range(32):
                                for half in range(2):
                                    pp = p0 + warp * 16 + lane // 4 + half * 8
                                    i = pp // group
                                    rows_hi[lane, half] = (
                                        min(kv_len - q_len + i, cap - 1) if pp < p1 else -1
                                    )
                                    rows_lo[lane, half] = attn_row_key_lo(
                                        kv_len, q_len, i, window_left
                                    )
                            warp_state = dict(
                                active=warp_active,
                                lo=rows_lo,
                                hi=rows_hi,
                                o=np.zeros((d // 8, 32, 4), np.float32),
                                m=np.full((32, 2), NEG_INF, np.float32),
                                l=np.zeros((32, 2), np.float32),
                            )
                            if warp_active:
                                qa = []
                                for kk in range(d // 16):
                                    addrs = [
                                        (warp * 16 + (lane & 15)) * d * 2
                                        + (((kk * 2 + (lane >> 4)) ^ (lane & 7)) << 4)
                                        for lane in range(32)
                                    ]
                                    qa.append(ldmatrix_x4(smem, addrs))
                                warp_state["qa"] = qa
                            if warp == 0:
                                states = []
                            states.append(warp_state)
                        for it in range(n_tiles):
                            nt = it + STAGES - 1
                            if nt < n_tiles:
                                load_kv(kt_begin + nt, nt % STAGES)
                            stage = it % STAGES
                            sk = s_k + stage * tile_bytes
                            sv = s_v + stage * tile_bytes
                            key0 = (kt_begin + it) * BLOCK_N
                            need_mask = key0 < tk["max_lo"] or key0 + BLOCK_N - 1 > tk["min_hi"]
                            for ws in states:
                                if not ws["active"]:
                                    continue
                                s = np.zeros((BLOCK_N // 8, 32, 4), np.float32)
                                for kk in range(d // 16):
                                    for j in range(0, BLOCK_N // 8, 2):
                                        addrs = [
                                            sk
                                            + (((lane >> 4) << 3) + (lane & 7)) * d * 2
                                            + j * 8 * d * 2
                                            + (((kk * 2 + ((lane >> 3) & 1)) ^ (lane & 7)) << 4)
                                            for lane in range(32)
                                        ]
                                        bfr = ldmatrix_x4(smem, addrs)
                                        mma(s[j], ws["qa"][kk], bfr[:, 0], bfr[:, 1])
                                        mma(s[j + 1], ws["qa"][kk], bfr[:, 2], bfr[:, 3])
                                s *= scale_log2
                                if need_mask:
                                    for j in range(BLOCK_N // 8):
                                        for lane in range(32):
                                            for e in range(4):
                                                key = key0 + j * 8 + ((lane & 3) << 1) + (e & 1)
                                                half = e >> 1
                                                if (
                                                    key < ws["lo"][lane, half]
                                                    or key > ws["hi"][lane, half]
                                                ):
                                                    s[j, lane, e] = NEG_INF
                                for half in range(2):
                                    cols = [2 * half, 2 * half + 1]
                                    mx = s[:, :, cols].max(axis=(0, 2))  # per lane
                                    mx = np.array(
                                        [
                                            mx[(ln // 4) * 4 : (ln // 4) * 4 + 4].max()
                                            for ln in range(32)
                                        ]
                                    )
                                    m_new = np.maximum(ws["m"][:, half], mx)
                                    m_use = np.where(m_new == NEG_INF, 0, m_new).astype(np.float32)
                                    alpha = np.exp2(ws["m"][:, half] - m_use)
                                    ws["m"][:, half] = m_new
                                    pvals = np.exp2(s[:, :, cols] - m_use[None, :, None])
                                    s[:, :, cols] = pvals
                                    ws["l"][:, half] = ws["l"][:, half] * alpha + pvals.sum(
                                        axis=(0, 2)
                                    )
                                    ws["o"][:, :, cols] *= alpha[None, :, None]
                                for kk in range(BLOCK_N // 16):
                                    pa = np.zeros((32, 4, 2), np.float32)
                                    pa[:, 0] = bf16_round(s[2 * kk][:, 0:2])
                                    pa[:, 1] = bf16_round(s[2 * kk][:, 2:4])
                                    pa[:, 2] = bf16_round(s[2 * kk + 1][:, 0:2])
                                    pa[:, 3] = bf16_round(s[2 * kk + 1][:, 2:4])
                                    for c in range(0, d // 8, 2):
                                        addrs = [
                                            sv
                                            + ((lane & 7) + (((lane >> 3) & 1) << 3)) * d * 2
                                            + kk * 16 * d * 2
                                            + (((c + (lane >> 4)) ^ (lane & 7)) << 4)
                                            for lane in range(32)
                                        ]
                                        bfr = ldmatrix_x4(smem, addrs, trans=True)
                                        mma(ws["o"][c], pa, bfr[:, 0], bfr[:, 1])
                                        mma(ws["o"][c + 1], pa, bfr[:, 2], bfr[:, 3])
                        # epilogue
                        for warp, ws in enumerate(states):
                            if not ws["active"]:
                                continue
                            for half in range(2):
                                lq = ws["l"][:, half]
                                lsum = np.array(
                                    [
                                        lq[(ln // 4) * 4 : (ln // 4) * 4 + 4].sum()
                                        for ln in range(32)
                                    ]
                                )
                                for lane in range(32):
                                    pp = p0 + warp * 16 + (lane >> 2) + half * 8
                                    if pp >= p1:
                                        continue
                                    t = q_start + pp // group
                                    h = g * group + pp % group
                                    m = ws["m"][lane, half]
                                    l_ = lsum[lane]
                                    dcol = (lane & 3) << 1
                                    vals = ws["o"][:, lane, 2 * half : 2 * half + 2]  # [d/8, 2]
                                    if n_split == 1:
                                        o_scale, lv = 0.0, NEG_INF
                                        if sinks is not None:
                                            sink = sinks[h] * LOG2E
                                            if l_ > 0:
                                                mm = max(m, sink)
                                                w = 2.0 ** (m - mm)
                                                l_tot = l_ * w + 2.0 ** (sink - mm)
                                                o_scale = w / l_tot
                                                lv = (mm + math.log2(l_tot)) * LN2
                                            else:
                                                lv = sinks[h]
                                        elif l_ > 0:
                                            o_scale = 1.0 / l_
                                            lv = (m + math.log2(l_)) * LN2
                                        for c in range(d // 8):
                                            out[t, h, c * 8 + dcol : c * 8 + dcol + 2] = bf16_round(
                                                vals[c] * o_scale
                                            )
                                        if lane & 3 == 0:
                                            lse[t, h] = lv
                                    else:
                                        inv = 1.0 / l_ if l_ > 0 else 0.0
                                        for c in range(d // 8):
                                            ws_out[split, t, h, c * 8 + dcol : c * 8 + dcol + 2] = (
                                                vals[c] * inv
                                            )
                                        if lane & 3 == 0:
                                            ws_lse[split, t, h] = (
                                                m + math.log2(l_) if l_ > 0 else NEG_INF
                                            )
    # merge kernel
    if max_splits > 1:
        for t in range(t_total):
            rr = -1
            for r in range(b):
                qs, ql, _ = request(r)
                if qs <= t < qs + ql:
                    rr = r
            if rr < 0:
                continue
            q_start, q_len, kv_len = request(rr)
            for h in range(hq):
                g = h // group
                pp = (t - q_start) * group + (h - g * group)
                p0 = pp // block_m * block_m
                p1 = min(p0 + block_m, q_len * group)
                tk = tile_keys(kv_len, q_len, p0, p1, group, window_left, cap)
                n_split = split_count(tk["ntk"], max_splits, num_splits)
                if n_split <= 1:
                    continue
                mx = max(ws_lse[s, t, h] for s in range(n_split))
                if mx == NEG_INF:
                    out[t, h] = 0
                    lse[t, h] = sinks[h] if sinks is not None else NEG_INF
                    continue
                if sinks is not None:
                    mx = max(mx, sinks[h] * LOG2E)
                acc = np.zeros(d, np.float64)
                l_ = 2.0 ** (sinks[h] * LOG2E - mx) if sinks is not None else 0.0
                for s in range(n_split):
                    w = 2.0 ** (ws_lse[s, t, h] - mx)
                    l_ += w
                    acc += w * ws_out[s, t, h]
                out[t, h] = bf16_round(acc / l_)
                lse[t, h] = (mx + math.log2(l_)) * LN2
    return out, lse, (block_m, q_tile_ctas, max_splits)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_paged_attention import make_problem

    gen = torch.Generator().manual_seed(1)
    cases = [
        # (q_lens, kv_lens, hq, hkv, d, bs, kwargs)
        ([14, 1, 5, 0], [150, 37, 3, 9], 8, 2, 64, 16, {"max_query_len": 14}),
        ([14, 3], [300, 40], 8, 1, 64, 8, {"max_query_len": 14, "num_splits": 3}),
        ([6, 2], [200, 5], 4, 2, 128, 32, {"max_query_len": 2, "window_left": 70}),
        ([4, 9], [2, 130], 4, 4, 64, 16, {"num_splits": 2, "sinks": True}),
        ([40], [300], 16, 2, 64, 16, {"max_query_len": 40, "num_splits": 2, "window_left": 100}),
        ([3], [700], 16, 2, 64, 128, {"max_query_len": 3, "num_sms": 4}),
        ([40, 2], [90, 260], 8, 1, 64, 16, {"max_query_len": 1, "sinks": True}),  # q-tile loop
        ([30], [250], 6, 2, 64, 16, {"max_query_len": 30, "num_splits": 2}),  # G=3 cuts rows
    ]
    for q_lens, kv_lens, hq, hkv, d, bs, kw in cases:
        pb = make_problem(gen, q_lens, kv_lens, hq, hkv, d, bs, torch.bfloat16, "cpu", t_pad=2)
        kw = dict(kw)
        sinks = None
        if kw.pop("sinks", False):
            sinks = (torch.randn(hq, generator=gen) * 2).numpy()
        scale = 1 / math.sqrt(d)
        pbd = {k: getattr(pb, k) for k in pb.__dataclass_fields__}
        out, lse, cfg = emulate(pbd, scale, sinks=sinks, **kw)
        ref, ref_lse = paged_attention_ref(
            pb.query, pb.key_cache, pb.value_cache, pb.block_table, pb.query_start_loc,
            pb.seq_lens, softmax_scale=scale, window_left=kw.get("window_left", -1),
            sinks=None if sinks is None else torch.from_numpy(sinks),
        )  # fmt: skip
        assert not np.isnan(out).any() and not np.isnan(lse).any(), "unwritten output"
        err = np.abs(out - ref.numpy()).max()
        fin = np.isfinite(ref_lse.numpy())
        assert (np.isfinite(lse) == fin).all(), "lse -inf pattern"
        lerr = np.abs(lse[fin] - ref_lse.numpy()[fin]).max() if fin.any() else 0.0
        print(f"q={q_lens} kv={kv_lens} {hq}/{hkv}x{d} bs={bs} {kw} cfg={cfg}: "
              f"max|out-ref|={err:.2e} max|lse-ref|={lerr:.2e}")  # fmt: skip
        assert err < 2e-2 and lerr < 1e-3


if __name__ == "__main__":
    main()
