"""Lane-level numpy emulation of csrc/cuda/paged_attention.cu, for checking the kernel's index
math without a GPU (the CPU CI machine has none).

It mirrors the kernel line by line: the plan (tensor-core path, tile sizes, ring depth, split
cap), the 1-D grid (KV heads fastest, then splits, requests; inert-row CTAs last), packed
(row, head) query tiles, tile_keys / split_count, the per-thread K/V copy assignment and the
block-id prefetch one tile ahead, the cp.async group ring, the panelled 128-byte-swizzle
shared-memory tiles, the exp2-domain online softmax (FFMA form, rescale only on a changed
maximum, Q sign flip for a negative scale), the epilogue (direct or fp32 partials) and the merge
kernel. The two tensor-core paths are modelled from the PTX ISA definitions, independently of
the kernel code:

* mma.sync: ldmatrix (.x4, .trans) and mma.m16n8k16 fragment layouts;
* wgmma: the matrix descriptor is decoded (start, LBO, SBO, 128-byte swizzle applied to the
  absolute address bits) and B is gathered through CuTe's canonical K-major / MN-major layouts;
  A and D go through CuTe's ALayout_64x16 / CLayout_64xN register layouts.

Every block-table read is checked against the columns the request may read (SPEC §5), and
cp.async data is applied either at issue or only at the wait that guarantees it (two runs):
a stage overwritten before it is consumed, or read before its group completed, corrupts the
result. bf16 rounding of Q/K/V, P and the output is modelled with torch. Slow (Python loops over
lanes): small problems only.

    python tools/emulate_paged_attention.py          # random cases vs tests/reference
"""

# ruff: noqa: B023  (the loader closures use the current tile's values on purpose, like the kernel)
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from reference.paged_attention import paged_attention_ref  # noqa: E402

MIN_TILES_PER_SPLIT = 2
MAX_AUTO_SPLITS = 64
MAX_CLUSTER = 8
STATS = {"level2_merges": 0}  # slices merged by a last-arriving cluster (all cases)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NEG_INF = -math.inf
FLT_MIN = np.float32(1.17549435e-38)
LANES = np.arange(32)


def bf16_round(x):
    return torch.from_numpy(np.asarray(x, dtype=np.float32)).bfloat16().float().numpy()


def f32(x):
    return np.float32(x)


# ---- PTX fragment semantics --------------------------------------------------------------------


def tile_offset(rows, row, chunk):
    """Byte offset of 16-byte chunk `chunk` of row `row` in a [rows, D] panelled tile."""
    return (chunk >> 3) * (rows * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4)


def ldmatrix_x4(smem, addrs, trans=False):
    """addrs[lane] = byte address of row lane % 8 of matrix lane // 8. Returns regs[32, 4, 2]."""
    regs = np.zeros((32, 4, 2), dtype=np.float32)
    g, t = LANES // 4, LANES % 4
    for j in range(4):
        mat = np.stack([smem[addrs[8 * j + r] // 2 : addrs[8 * j + r] // 2 + 8] for r in range(8)])
        if trans:
            regs[:, j, 0] = mat[2 * t, g]
            regs[:, j, 1] = mat[2 * t + 1, g]
        else:
            regs[:, j, 0] = mat[g, 2 * t]
            regs[:, j, 1] = mat[g, 2 * t + 1]
    return regs


def mma(d, a, b0, b1):
    """d[32, 4] += A(16x16 from a[32,4,2]) @ B(16x8 from b0/b1[32,2]) (m16n8k16)."""
    g, t = LANES // 4, LANES % 4
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    C = np.zeros((16, 8))
    for e in range(2):
        A[g, 2 * t + e] = a[:, 0, e]
        A[g + 8, 2 * t + e] = a[:, 1, e]
        A[g, 8 + 2 * t + e] = a[:, 2, e]
        A[g + 8, 8 + 2 * t + e] = a[:, 3, e]
        B[2 * t + e, g] = b0[:, e]
        B[8 + 2 * t + e, g] = b1[:, e]
        C[g, 2 * t + e] = d[:, e]
        C[g + 8, 2 * t + e] = d[:, 2 + e]
    C = (C + A @ B).astype(np.float32)
    for e in range(2):
        d[:, e] = C[g, 2 * t + e]
        d[:, 2 + e] = C[g + 8, 2 * t + e]


def wgmma_b(smem, desc, n, trans_b):
    """B[16, n] read by wgmma through a 128-byte-swizzle shared-memory descriptor."""
    start = (desc & 0x3FFF) << 4
    lbo = ((desc >> 16) & 0x3FFF) << 4
    sbo = ((desc >> 32) & 0x3FFF) << 4
    assert desc >> 62 == 1, "expected the 128-byte swizzle mode"
    k = np.arange(16)[:, None]
    nn = np.arange(n)[None, :]
    if not trans_b:  # K-major ((8,n),(8 elem, 2)):((128 B, SBO),(2 B, 16 B))
        addr = start + (nn // 8) * sbo + (nn % 8) * 128 + (k // 8) * 16 + (k % 8) * 2
    else:  # MN-major ((8 elem, 8, m),(8, k)):((2 B, 16 B, LBO),(128 B, SBO))
        addr = start + (nn // 64) * lbo + ((nn % 64) // 8) * 16 + (nn % 8) * 2
        addr = addr + (k % 8) * 128 + (k // 8) * sbo
    addr = addr ^ (((addr >> 7) & 7) << 4)
    return smem[addr // 2]


def wgmma(d, a, b, scale_d):
    """One warpgroup: d[4 warps, 32, n/8, 4] (=)+= A[64, 16] (a[4, 32, 4, 2]) @ b[16, n]."""
    n = b.shape[1]
    g, t = LANES // 4, LANES % 4
    A = np.zeros((64, 16))
    C = np.zeros((64, n))
    for w in range(4):
        row = 16 * w + g
        for e in range(2):  # ALayout_64x16: values (v0, v1 -> row + 8, v2 -> k + 8)
            A[row, 2 * t + e] = a[w, :, 0, e]
            A[row + 8, 2 * t + e] = a[w, :, 1, e]
            A[row, 8 + 2 * t + e] = a[w, :, 2, e]
            A[row + 8, 8 + 2 * t + e] = a[w, :, 3, e]
        for j in range(n // 8):  # CLayout_64xN
            for e in range(2):
                C[row, 8 * j + 2 * t + e] = d[w, :, j, e]
                C[row + 8, 8 * j + 2 * t + e] = d[w, :, j, 2 + e]
    C = ((C if scale_d else 0.0) + A @ b.astype(np.float64)).astype(np.float32)
    for w in range(4):
        row = 16 * w + g
        for j in range(n // 8):
            for e in range(2):
                d[w, :, j, e] = C[row, 8 * j + 2 * t + e]
                d[w, :, j, 2 + e] = C[row + 8, 8 * j + 2 * t + e]


def wgmma_desc(addr, lbo, sbo):
    return ((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (1 << 62)


# ---- shared device logic (mirrors paged_attention_device.cuh) ----------------------------------


def attn_row_key_lo(kv_len, q_len, i, window_left):
    if window_left < 0:
        return 0
    return max(0, kv_len - q_len + i - window_left)


def tile_keys(kv_len, q_len, p0, p1, group, window_left, cap, block_n):
    i_first, i_last = p0 // group, (p1 - 1) // group
    hi_max = min(kv_len - q_len + i_last, cap - 1)
    min_hi = min(kv_len - q_len + i_first, cap - 1)
    lo_min = attn_row_key_lo(kv_len, q_len, i_first, window_left)
    max_lo = attn_row_key_lo(kv_len, q_len, i_last, window_left)
    if hi_max < lo_min:
        kt0, ntk = 0, 0
    else:
        kt0 = lo_min // block_n
        ntk = hi_max // block_n - kt0 + 1
    return dict(lo_min=lo_min, hi_max=hi_max, kt0=kt0, ntk=ntk, min_hi=min_hi, max_lo=max_lo)


def split_count(ntk, max_splits, fixed):
    if ntk <= 1:
        return 1
    s = fixed if fixed > 0 else min(max_splits, -(-ntk // MIN_TILES_PER_SPLIT))
    s = max(1, min(s, ntk))
    per = -(-ntk // s)
    return -(-ntk // per)


def kernel_cfg(d, block_m, wg, block_n):
    """AttnCfg of the .cu."""
    warps = block_m // 16 if wg else (4 if (d == 64 and block_m == 128) else block_m // 16)
    mt = block_m // (16 * warps)
    threads = warps * 32
    min_blocks = 1 if (block_m == 128 and d == 128) else 2
    chunks = d // 8
    q_bytes = block_m * d * 2
    tile_bytes = block_n * d * 2
    budget = (112 if min_blocks == 2 else 224) * 1024
    stages = min(6, (budget - q_bytes) // (2 * tile_bytes))
    rows_per_pass = threads // chunks
    return dict(warps=warps, mt=mt, threads=threads, chunks=chunks, q_bytes=q_bytes,
                tile_bytes=tile_bytes, stages=stages, rpp=rows_per_pass,
                passes=block_n // rows_per_pass, min_blocks=min_blocks)  # fmt: skip


def cluster_size(splits, max_cluster=MAX_CLUSTER):
    c = 1
    while c * 2 <= splits and c * 2 <= max_cluster:
        c *= 2
    return c


def cluster_splits(active, cluster, base, splits):
    if active < 1 or cluster < 2:
        return 0
    need = -(-splits // cluster)
    per = active // base if base > 0 else 1
    return max(1, min(per, need)) * cluster


def plan(b, hq, hkv, d, t_total, max_query_len, num_splits, impl="auto", arch=90, num_sms=132,
         merge="auto", active_clusters=None):  # fmt: skip
    """plan_paged_attention. ``active_clusters(c)``: the device's resident clusters of c CTAs
    (cudaOccupancyMaxActiveClusters); default: every SM slot usable, SMs x CTAs per SM / c."""
    group = hq // hkv
    block_m = 64 if group <= 4 else 128
    wg = arch == 90 and group >= 4
    if "wgmma" in impl:
        wg = arch == 90
    elif "mma" in impl:
        wg = False
    block_n = 32 if ("n32" in impl and d == 128 and block_m == 64) else 64
    packed = group * max(1, max_query_len)
    q_tiles = -(-packed // block_m)
    limit = 2**31 - 1 - 64
    reqs_heads = max(1, b * hkv)
    max_q_ctas = max(1, limit // (reqs_heads * (num_splits if num_splits > 0 else 1)))
    q_tile_ctas = min(q_tiles, max_q_ctas)
    per_sm = kernel_cfg(d, block_m, wg, block_n)["min_blocks"]  # the occupancy the .cu queries
    if num_splits > 0:
        max_splits = num_splits
    else:
        base = b * hkv * q_tile_ctas
        s = (num_sms * per_sm) // base if base else 1
        s = min(s, limit // (reqs_heads * q_tile_ctas))
        max_splits = max(1, min(MAX_AUTO_SPLITS, s))
    base = b * hkv * q_tile_ctas
    if active_clusters is None:
        active_clusters = lambda c: (num_sms * per_sm) // c  # noqa: E731
    cluster, cluster_count = 1, 1
    if max_splits > 1 and arch >= 90 and "kernel" not in merge:  # choose_cluster
        if num_splits > 0:
            cluster = cluster_size(max_splits)
            cluster_count = -(-max_splits // cluster)
        else:
            best_c, best_s = 1, 0
            c = cluster_size(max_splits)
            while c >= 2:
                sp = cluster_splits(active_clusters(c), c, base, max_splits)
                if sp > best_s:
                    best_c, best_s = c, sp
                c //= 2
            if best_c >= 2 and best_s >= 2:
                cluster, cluster_count, max_splits = best_c, best_s // best_c, best_s
    split_ctas = cluster * cluster_count if cluster > 1 else max_splits
    if cluster > 1:
        ws_partials = cluster_count if cluster_count > 1 else 0
    else:
        ws_partials = max_splits if max_splits > 1 else 0
    inert = min(8, max(1, t_total))
    inert = -(-inert // cluster) * cluster  # whole clusters of their own
    return dict(block_m=block_m, block_n=block_n, wg=wg, q_tile_ctas=q_tile_ctas,
                max_splits=max_splits, inert=inert, cluster=cluster, cluster_count=cluster_count,
                ws_partials=ws_partials, grid=inert + base * split_ctas)  # fmt: skip


# ---- the kernel --------------------------------------------------------------------------------


class Smem:
    """Shared memory (fp32 per b16 element, NaN-poisoned) with cp.async groups."""

    def __init__(self, nbytes, land_at_issue):
        self.a = np.full(nbytes // 2, np.nan, dtype=np.float32)
        self.land_at_issue = land_at_issue
        self.pending = []  # committed groups: lists of (dst element, values)
        self.open = []

    def cp_async(self, dst_byte, values):
        if self.land_at_issue:
            self.a[dst_byte // 2 : dst_byte // 2 + 8] = values
        else:
            self.open.append((dst_byte // 2, values.copy()))

    def commit(self):
        self.pending.append(self.open)
        self.open = []

    def wait(self, n):
        while len(self.pending) > n:
            for dst, v in self.pending.pop(0):
                self.a[dst : dst + 8] = v


def exp2_f32(x):
    with np.errstate(over="ignore", invalid="ignore"):
        return np.exp2(np.float32(x)).astype(np.float32)


def merge_row(lses, rows, sink_l2):
    """The kernel's merge of partial rows (lse log2 domain, rows fp32 [n, d]) in index order; with
    sink_l2 (sink * log2 e, final level only): returns (o, lse natural log) of the output row,
    else the merged partial (o normalised, lse log2)."""
    mx = np.float32(NEG_INF)
    for v in lses:
        mx = np.float32(np.nan) if (np.isnan(v) or np.isnan(mx)) else max(mx, np.float32(v))
    final = sink_l2 is not False
    if mx == NEG_INF:
        if final:
            return np.zeros(rows.shape[1], np.float32), (NEG_INF if sink_l2 is None else None)
        return np.zeros(rows.shape[1], np.float32), NEG_INF
    m_ref = mx
    if final and sink_l2 is not None:
        m_ref = np.float32(np.fmax(mx, np.float32(sink_l2)))  # fmaxf: NaN mx gives the sink
    acc = np.zeros(rows.shape[1], np.float32)
    l_ = np.float32(0)
    for v, x in zip(lses, rows, strict=True):
        w = exp2_f32(np.float32(v) - m_ref)
        acc = (w * x + acc).astype(np.float32)
        l_ = np.float32(l_ + w)
    if final:
        if sink_l2 is not None:
            l_ = np.float32(l_ + exp2_f32(np.float32(sink_l2) - m_ref))
        inv = np.float32(1) / l_
        return (acc * inv).astype(np.float32), np.float32((m_ref + np.log2(l_)) * LN2)
    inv = np.float32(1) / l_ if l_ != 0 else np.float32(0)
    return (acc * inv).astype(np.float32), (m_ref + np.float32(np.log2(l_)) if l_ != 0 else NEG_INF)


def cluster_merge(parts, out, lse, ws_out, ws_lse, counters, order, seed, cluster, block_m, group,
                  hq, t_total, sinks, request):  # fmt: skip
    """Level 1 (each rank's slice over its cluster's C partials, read as through DSMEM after the
    cluster barrier) and level 2 (slot write, then arrival at the slice's counter; the CTA that
    draws ticket nc - 1 resets it and merges slots 0 .. nc - 1), the level-2 events in `order`.
    ws slots are NaN until written, so a merge that ran before every slot landed shows NaN."""
    rows_per_rank = block_m // cluster
    events = []  # (r, g, p0, p1, c, rank, nc, merged partial slice)
    for (r, g, p0, p1, n_split, c), ranks in parts.items():
        assert sorted(ranks) == list(range(cluster)), "every rank of an active cluster writes"
        nc = -(-n_split // cluster)
        q_start = request(r)[0]
        for rank in range(cluster):
            r0 = rank * rows_per_rank
            if r0 >= p1 - p0:
                continue
            sl = []
            for row in range(r0, min(r0 + rows_per_rank, p1 - p0)):
                pp = p0 + row
                t, h = q_start + pp // group, g * group + pp % group
                lses = [ranks[s][1][row] for s in range(cluster)]
                rows = np.stack([ranks[s][0][row] for s in range(cluster)])
                if nc == 1:
                    sink = None if sinks is None else float(sinks[h]) * LOG2E
                    ov, lv = merge_row(lses, rows, sink)
                    out[t, h] = bf16_round(ov)
                    lse[t, h] = lv if lv is not None else sinks[h]
                else:
                    sl.append((t, h, merge_row(lses, rows, False)))
            if nc > 1:
                events.append((r, g, p0, p1, c, rank, nc, sl))
    if order == "descending":
        events = events[::-1]
    elif order == "random":
        rng = np.random.default_rng(seed)
        events = [events[i] for i in rng.permutation(len(events))]
    written, merged = set(), set()
    for _r, _g, _p0, _p1, c, _rank, nc, sl in events:
        for t, h, (ov, lv) in sl:  # this cluster's partial of the slice -> slot c
            ws_out[c, t, h] = ov
            ws_lse[c, t, h] = lv
        t0, h0 = sl[0][0], sl[0][1]  # counter of the slice's first (row, head)
        key = t0 * hq + h0
        written.add((key, c))
        ticket = counters[key]
        counters[key] += 1
        if ticket != nc - 1:
            continue
        counters[key] = 0  # the last arriver resets it
        assert all((key, cc) in written for cc in range(nc)), "merged before every slot landed"
        assert key not in merged, "a slice merged twice"
        merged.add(key)
        STATS["level2_merges"] += 1
        for t, h, _ in sl:
            sink = None if sinks is None else float(sinks[h]) * LOG2E
            ov, lv = merge_row([ws_lse[cc, t, h] for cc in range(nc)], ws_out[:nc, t, h], sink)
            out[t, h] = bf16_round(ov)
            lse[t, h] = lv if lv is not None else sinks[h]
    slices = {ev[7][0][0] * hq + ev[7][0][1] for ev in events}  # events have nc > 1
    assert merged == slices, "a slice was never merged"


def emulate(pb, softmax_scale, window_left=-1, sinks=None, max_query_len=-1, num_splits=0,
            impl="auto", land_at_issue=True, counters=None, orders=("ascending",), seed=0,
            **kw):  # fmt: skip
    """Returns (out, lse, plan). Cluster merge: ``counters`` is the persistent arrival-counter
    buffer (zeroed uint32 [T * Hq], checked zero again afterwards; a fresh one if None) and the
    level-2 arrivals run in each of ``orders`` ("ascending", "descending", "random"), which must
    all give bit-identical results."""
    q = bf16_round(pb["query"].float().numpy())
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
    pl = plan(b, hq, hkv, d, t_total, hint, num_splits, impl=impl, **kw)
    block_m, block_n, wg = pl["block_m"], pl["block_n"], pl["wg"]
    q_tile_ctas, max_splits = pl["q_tile_ctas"], pl["max_splits"]
    cfg = kernel_cfg(d, block_m, wg, block_n)
    stages, passes, rpp, chunks, threads = (
        cfg["stages"], cfg["passes"], cfg["rpp"], cfg["chunks"], cfg["threads"]
    )  # fmt: skip
    kmt = cfg["mt"]
    q_bytes, tile_bytes = cfg["q_bytes"], cfg["tile_bytes"]
    stage_bytes = 2 * tile_bytes
    out = np.full((t_total, hq, d), np.nan, dtype=np.float32)
    lse = np.full((t_total, hq), np.nan, dtype=np.float32)
    cluster, cluster_count = pl["cluster"], pl["cluster_count"]
    ws_out = np.full((max(1, pl["ws_partials"]), t_total, hq, d), np.nan, dtype=np.float32)
    ws_lse = np.full((max(1, pl["ws_partials"]), t_total, hq), np.nan, dtype=np.float32)
    if counters is None:
        counters = np.zeros(t_total * hq, np.int64)
    assert (counters == 0).all(), "arrival counters must be zero before a launch"
    cluster_parts = {}  # (r, g, p0, p1, n_split, c) -> {rank: (part [block_m, d], lse [block_m])}
    sl = max(f32(abs(softmax_scale) * LOG2E), FLT_MIN)
    q_sign = -1.0 if softmax_scale < 0 else 1.0
    heads_tiles = hkv * q_tile_ctas
    table_reads = set()

    def request(r):
        qs = min(max(int(qsl[r]), 0), t_total)
        qe = min(max(int(qsl[r + 1]), qs), t_total)
        return qs, qe - qs, max(int(seq[r]), 0)

    # inert rows (the last pl["inert"] CTAs)
    lo = min(max(int(qsl[0]), 0), t_total) if b else 0
    hi = min(max(int(qsl[b]), lo), t_total) if b else 0
    for t in list(range(0, lo)) + list(range(hi, t_total)):
        out[t] = 0
        lse[t] = NEG_INF

    tids = np.arange(threads)
    kv_chunk, kv_row0 = tids % chunks, tids // chunks

    for cta in range(pl["grid"] - pl["inert"]):
        if cluster > 1:  # (request, cluster, KV head x query-tile CTA, rank)
            rank = cta % cluster
            rest0 = cta // cluster
            ht = rest0 % heads_tiles
            rest = rest0 // heads_tiles
            split = rest % cluster_count * cluster + rank
            r = rest // cluster_count
        else:
            rank = 0
            ht = cta % heads_tiles
            rest = cta // heads_tiles
            split = rest % max_splits
            r = rest // max_splits
        g = ht % hkv
        q_cta = ht // hkv
        q_start, q_len, kv_len = request(r)
        if q_len == 0:
            continue
        packed_total = q_len * group
        n_qtiles = -(-packed_total // block_m)
        for q_iter in range(q_cta, n_qtiles, q_tile_ctas):
            qt = n_qtiles - 1 - q_iter
            p0 = qt * block_m
            p1 = min(p0 + block_m, packed_total)
            tk = tile_keys(kv_len, q_len, p0, p1, group, window_left, cap, block_n)
            n_split = split_count(tk["ntk"], max_splits, num_splits)
            if cluster > 1:
                # cluster-uniform skip; an empty split of an active cluster takes part
                if (split > 0) if n_split == 1 else (split - rank >= n_split):
                    continue
            elif split >= n_split:
                continue
            per = -(-tk["ntk"] // n_split)
            kt_begin = tk["kt0"] + split * per
            n_tiles = max(0, min(tk["kt0"] + tk["ntk"], kt_begin + per) - kt_begin)

            def fetch_blocks(kt, valid):
                blk = np.full((threads, passes), -1, dtype=np.int64)
                if not valid:
                    return blk
                for j in range(passes):
                    key = kt * block_n + kv_row0 + j * rpp
                    ok = (key >= tk["lo_min"]) & (key <= tk["hi_max"])
                    for tid in np.nonzero(ok)[0]:
                        col = int(key[tid]) >> (bs.bit_length() - 1)
                        table_reads.add((r, col))
                        blk[tid, j] = int(table[r, col])
                return blk

            def issue_kv(kt, blk, stage):
                for tid in range(threads):
                    ch = kv_chunk[tid]
                    for j in range(passes):
                        key = kt * block_n + kv_row0[tid] + j * rpp
                        bid = int(blk[tid, j])
                        ok = 0 <= bid < num_blocks
                        dst = q_bytes + stage * stage_bytes + tile_offset(block_n, kv_row0[tid], ch)
                        dst += j * rpp * 128
                        for base, cache in ((0, kc), (tile_bytes, vc)):
                            if ok:
                                vals = cache[bid, key % bs, g, ch * 8 : ch * 8 + 8]
                            else:
                                vals = np.zeros(8, np.float32)
                            sm.cp_async(dst + base, vals)

            # per m16 tile u = warp * kmt + mt: row bounds, accumulators
            n16 = block_m // 16
            row_lo = np.zeros((n16, 32, 2), np.int64)
            row_hi = np.zeros((n16, 32, 2), np.int64)
            active = np.zeros(n16, bool)
            for u in range(n16):
                m0 = p0 + u * 16
                active[u] = m0 < p1
                for half in range(2):
                    pp = m0 + LANES // 4 + half * 8
                    i = pp // group
                    row_hi[u, :, half] = np.where(
                        pp < p1, np.minimum(kv_len - q_len + i, cap - 1), -1
                    )
                    row_lo[u, :, half] = [attn_row_key_lo(kv_len, q_len, x, window_left) for x in i]
            o = np.zeros((n16, 32, d // 8, 4), np.float32)
            row_m = np.full((n16, 32, 2), NEG_INF, np.float32)
            row_l = np.zeros((n16, 32, 2), np.float32)

            if n_tiles > 0:
                sm = Smem(q_bytes + stages * stage_bytes, land_at_issue)
                blks = [fetch_blocks(kt_begin + st, st < n_tiles) for st in range(stages)]
                for m in range(block_m):
                    for ch in range(chunks):
                        pp = p0 + m
                        if pp < p1:
                            t = q_start + pp // group
                            h = g * group + pp % group
                            vals = q[t, h, ch * 8 : ch * 8 + 8]
                        else:
                            vals = np.zeros(8, np.float32)
                        sm.cp_async(tile_offset(block_m, m, ch), vals)
                for st in range(stages - 1):
                    if st < n_tiles:
                        issue_kv(kt_begin + st, blks[st], st)
                    sm.commit()
                nblk = blks[stages - 1]
                sm.wait(stages - 2)
                qa = np.zeros((n16, d // 16, 32, 4, 2), np.float32)
                for u in range(n16):
                    if not wg and not active[u]:
                        continue
                    for kk in range(d // 16):
                        addrs = [
                            tile_offset(block_m, u * 16 + (ln & 15), kk * 2 + (ln >> 4))
                            for ln in range(32)
                        ]
                        qa[u, kk] = ldmatrix_x4(sm.a, addrs) * q_sign
                read_stage, write_stage = 0, stages - 1
                for it in range(n_tiles):
                    sm.wait(stages - 2)
                    nt = it + stages - 1
                    if nt < n_tiles:
                        issue_kv(kt_begin + nt, nblk, write_stage)
                    sm.commit()
                    nblk = fetch_blocks(kt_begin + nt + 1, nt + 1 < n_tiles)
                    write_stage = (write_stage + 1) % stages
                    sk = q_bytes + read_stage * stage_bytes
                    sv = sk + tile_bytes
                    read_stage = (read_stage + 1) % stages
                    key0 = (kt_begin + it) * block_n
                    s = np.zeros((n16, 32, block_n // 8, 4), np.float32)
                    if wg:
                        for w0 in range(0, n16, 4):  # warpgroups
                            acc = s[w0 : w0 + 4]
                            for kk in range(d // 16):
                                addr = sk + (kk >> 2) * (block_n * 128) + (kk & 3) * 32
                                bmat = wgmma_b(sm.a, wgmma_desc(addr, 16, 1024), block_n, False)
                                wgmma(acc, qa[w0 : w0 + 4, kk], bmat, kk > 0)
                            s[w0 : w0 + 4] = acc
                    else:
                        for u in range(n16):
                            if not active[u]:
                                continue
                            for kk in range(d // 16):
                                for j in range(0, block_n // 8, 2):
                                    addrs = []
                                    for ln in range(32):
                                        ch = kk * 2 + ((ln >> 3) & 1)
                                        k_row = ((ln >> 4) << 3) + (ln & 7) + j * 8
                                        addrs.append(sk + tile_offset(block_n, k_row, ch))
                                    bfr = ldmatrix_x4(sm.a, addrs)
                                    mma(s[u, :, j], qa[u, kk], bfr[:, 0], bfr[:, 1])
                                    mma(s[u, :, j + 1], qa[u, kk], bfr[:, 2], bfr[:, 3])
                    if key0 < tk["max_lo"] or key0 + block_n - 1 > tk["min_hi"]:
                        for j in range(block_n // 8):
                            for e in range(4):
                                key = key0 + j * 8 + ((LANES & 3) << 1) + (e & 1)
                                lo_, hi_ = row_lo[:, :, e >> 1], row_hi[:, :, e >> 1]
                                s[:, :, j, e] = np.where(
                                    (key[None] < lo_) | (key[None] > hi_), NEG_INF, s[:, :, j, e]
                                )
                    alpha = np.ones((n16, 32, 2), np.float32)
                    changed = np.zeros(n16 // kmt, bool)  # per warp
                    for u in range(n16):
                        if not active[u]:
                            continue
                        for half in range(2):
                            mx = s[u, :, :, 2 * half : 2 * half + 2].max(axis=(1, 2))
                            mx = np.maximum(mx, mx[LANES ^ 1])
                            mx = np.maximum(mx, mx[LANES ^ 2])
                            m_old = row_m[u, :, half]
                            with np.errstate(invalid="ignore"):
                                m_new = np.maximum(m_old, (mx * sl).astype(np.float32))
                            m_use = np.where(m_new == NEG_INF, 0, m_new).astype(np.float32)
                            ch_ = m_new != m_old
                            alpha[u, :, half] = np.where(ch_, np.exp2(m_old - m_use), 1.0)
                            if ch_.any():
                                changed[u // kmt] = True
                            row_m[u, :, half] = m_new
                            vals = s[u, :, :, 2 * half : 2 * half + 2].astype(np.float64)
                            p_ = np.exp2(vals * sl - m_use[:, None, None]).astype(np.float32)
                            s[u, :, :, 2 * half : 2 * half + 2] = p_
                            row_l[u, :, half] = row_l[u, :, half] * alpha[u, :, half] + p_.sum(
                                axis=(1, 2)
                            )
                    for u in range(n16):
                        if changed[u // kmt]:
                            o[u] *= alpha[u][:, None, [0, 0, 1, 1]]
                    if wg:
                        for w0 in range(0, n16, 4):
                            acc = o[w0 : w0 + 4]
                            for kk in range(block_n // 16):
                                pa = np.zeros((4, 32, 4, 2), np.float32)
                                for w in range(4):
                                    if not active[w0 + w]:
                                        continue
                                    pv = s[w0 + w]
                                    pa[w, :, 0] = bf16_round(pv[:, 2 * kk, 0:2])
                                    pa[w, :, 1] = bf16_round(pv[:, 2 * kk, 2:4])
                                    pa[w, :, 2] = bf16_round(pv[:, 2 * kk + 1, 0:2])
                                    pa[w, :, 3] = bf16_round(pv[:, 2 * kk + 1, 2:4])
                                bmat = wgmma_b(
                                    sm.a, wgmma_desc(sv + kk * 16 * 128, block_n * 128, 1024),
                                    d, True,
                                )  # fmt: skip
                                wgmma(acc, pa, bmat, True)
                            o[w0 : w0 + 4] = acc
                    else:
                        for u in range(n16):
                            if not active[u]:
                                continue
                            for kk in range(block_n // 16):
                                pa = np.zeros((32, 4, 2), np.float32)
                                pa[:, 0] = bf16_round(s[u, :, 2 * kk, 0:2])
                                pa[:, 1] = bf16_round(s[u, :, 2 * kk, 2:4])
                                pa[:, 2] = bf16_round(s[u, :, 2 * kk + 1, 0:2])
                                pa[:, 3] = bf16_round(s[u, :, 2 * kk + 1, 2:4])
                                for c in range(0, d // 8, 2):
                                    addrs = []
                                    for ln in range(32):
                                        ch = c + (ln >> 4)
                                        v_row = (ln & 7) + (((ln >> 3) & 1) << 3) + kk * 16
                                        addrs.append(sv + tile_offset(block_n, v_row, ch))
                                    bfr = ldmatrix_x4(sm.a, addrs, trans=True)
                                    mma(o[u, :, c], pa, bfr[:, 0], bfr[:, 1])
                                    mma(o[u, :, c + 1], pa, bfr[:, 2], bfr[:, 3])
            # epilogue
            if cluster > 1 and n_split > 1:  # the CTA's normalised partial -> its shared memory
                part = np.zeros((block_m, d), np.float32)
                part_lse = np.full(block_m, NEG_INF, np.float32)
                for u in range(n16):
                    for half in range(2):
                        lq = row_l[u, :, half]
                        lq = lq + lq[LANES ^ 1]
                        lq = lq + lq[LANES ^ 2]
                        for lane in range(32):
                            row = u * 16 + (lane >> 2) + half * 8
                            l_ = np.float32(lq[lane])
                            inv = np.float32(1.0) / l_ if l_ != 0 else np.float32(0.0)
                            dcol = (lane & 3) << 1
                            for c in range(d // 8):
                                part[row, c * 8 + dcol : c * 8 + dcol + 2] = (
                                    o[u, lane, c, 2 * half : 2 * half + 2] * inv
                                )
                            if lane & 3 == 0:
                                part_lse[row] = (
                                    row_m[u, lane, half] + np.float32(np.log2(l_))
                                    if l_ != 0
                                    else NEG_INF
                                )
                key = (r, g, p0, p1, n_split, split // cluster)
                cluster_parts.setdefault(key, {})[rank] = (part, part_lse)
                continue
            for u in range(n16):
                if not active[u]:
                    continue
                for half in range(2):
                    lq = row_l[u, :, half]
                    lq = lq + lq[LANES ^ 1]
                    lq = lq + lq[LANES ^ 2]
                    for lane in range(32):
                        pp = p0 + u * 16 + (lane >> 2) + half * 8
                        if pp >= p1:
                            continue
                        t = q_start + pp // group
                        h = g * group + pp % group
                        m = float(row_m[u, lane, half])
                        l_ = float(lq[lane])
                        dcol = (lane & 3) << 1
                        vals = o[u, lane, :, 2 * half : 2 * half + 2]  # [d/8, 2]
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
                                ws_out[split, t, h, c * 8 + dcol : c * 8 + dcol + 2] = vals[c] * inv
                            if lane & 3 == 0:
                                ws_lse[split, t, h] = m + math.log2(l_) if l_ > 0 else NEG_INF
    if cluster > 1:
        results = []
        for order in orders:
            o2, l2 = out.copy(), lse.copy()
            wso, wsl = ws_out.copy(), ws_lse.copy()
            cluster_merge(cluster_parts, o2, l2, wso, wsl, counters, order, seed, cluster,
                          block_m, group, hq, t_total, sinks, request)  # fmt: skip
            assert (counters == 0).all(), "a launch must leave the arrival counters zeroed"
            results.append((o2, l2))
        for o2, l2 in results[1:]:  # the arrival order never changes a bit
            assert np.array_equal(o2, results[0][0], equal_nan=True), "order-dependent out"
            assert np.array_equal(l2, results[0][1], equal_nan=True), "order-dependent lse"
        out, lse = results[0]
    # merge kernel
    if max_splits > 1 and cluster == 1:
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
                tk = tile_keys(kv_len, q_len, p0, p1, group, window_left, cap, block_n)
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
    # block-table columns each request may read (SPEC §5): those of keys its rows can see
    for r, col in table_reads:
        q_start, q_len, kv_len = request(r)
        assert q_len > 0 and kv_len > 0, f"read block_table[{r}, {col}] of an empty request"
        hi_key = min(kv_len - 1, cap - 1)
        lo_key = attn_row_key_lo(kv_len, q_len, 0, window_left)
        assert lo_key // bs <= col <= hi_key // bs, f"read block_table[{r}, {col}] out of range"
    return out, lse, pl


def main() -> None:
    from test_paged_attention import make_problem

    gen = torch.Generator().manual_seed(1)
    cases = [
        # (q_lens, kv_lens, hq, hkv, d, bs, kwargs)
        ([14, 1, 5, 0], [150, 37, 3, 9], 8, 2, 64, 16, {"max_query_len": 14}),
        ([14, 3], [300, 40], 16, 2, 64, 8, {"max_query_len": 14, "num_splits": 3}),
        ([14, 3], [300, 40], 16, 2, 64, 8, {"max_query_len": 14, "impl": "mma"}),
        ([6, 2], [200, 5], 16, 4, 128, 32, {"max_query_len": 2, "window_left": 70}),
        ([6, 2], [200, 5], 16, 4, 128, 32, {"window_left": 70, "impl": "wgmma-n32"}),
        ([14], [400], 16, 4, 128, 16, {"max_query_len": 14, "impl": "mma-n32", "num_sms": 2}),
        ([4, 9], [2, 130], 4, 4, 64, 16, {"num_splits": 2, "sinks": True}),
        ([4, 9], [2, 130], 16, 4, 64, 16, {"num_splits": 2, "sinks": True, "scale": -0.2}),
        ([40], [300], 16, 2, 64, 16, {"max_query_len": 40, "num_splits": 2, "window_left": 100}),
        ([3], [700], 16, 2, 64, 128, {"max_query_len": 3, "num_sms": 4}),
        ([40, 2], [90, 260], 8, 1, 64, 16, {"max_query_len": 1, "sinks": True}),  # q-tile loop
        ([30], [250], 12, 2, 64, 16, {"max_query_len": 30, "num_splits": 2}),  # G=6 cuts rows
        ([14, 2], [90, 40], 8, 1, 128, 16, {"max_query_len": 14, "scale": 0.0}),  # 128x128
        # merge kernel (PEAGLE_ATTN_MERGE=kernel / sm_100 before clusters) next to the cluster merge
        (
            [14, 3],
            [300, 40],
            16,
            2,
            64,
            8,
            {"max_query_len": 14, "num_splits": 3, "merge": "kernel"},
        ),
        ([14, 1, 5], [400, 37, 3], 8, 2, 64, 16, {"max_query_len": 14, "merge": "kernel"}),
        # cluster merge, one level: 8 splits, one 8-CTA cluster (B=1 decode shape, G = 4)
        ([14], [1100], 16, 4, 128, 16, {"max_query_len": 14, "num_splits": 8}),
        # two levels: 16+ splits in 8-CTA clusters, slices merged by the last cluster to arrive
        ([14], [1100], 16, 4, 64, 16, {"max_query_len": 14}),
        ([14], [1100], 16, 2, 64, 16, {"max_query_len": 14, "sinks": True, "window_left": 900}),
        # ragged B > 1: clusters of a request that needs fewer splits skip, empty splits take part
        ([14, 14, 2, 0], [1100, 200, 700, 5], 16, 2, 64, 16, {"max_query_len": 14}),
        # G = 8 (128-row tiles, 16 rows per rank), a 5-split fixed plan (4 + 1 idle 3 in cluster 2)
        ([14], [900], 16, 2, 64, 16, {"max_query_len": 14, "num_splits": 5}),
        # resident clusters scarce: the plan picks the cluster size that holds most splits
        ([14], [1100], 16, 4, 64, 16, {"max_query_len": 14, "active_clusters": lambda c: 5}),
    ]
    for q_lens, kv_lens, hq, hkv, d, bs, kw in cases:
        pb = make_problem(gen, q_lens, kv_lens, hq, hkv, d, bs, torch.bfloat16, "cpu", t_pad=2)
        kw = dict(kw)
        sinks = None
        if kw.pop("sinks", False):
            sinks = (torch.randn(hq, generator=gen) * 2).numpy()
        scale = kw.pop("scale", 1 / math.sqrt(d))
        pbd = {k: getattr(pb, k) for k in pb.__dataclass_fields__}
        ref, ref_lse = paged_attention_ref(
            pb.query, pb.key_cache, pb.value_cache, pb.block_table, pb.query_start_loc,
            pb.seq_lens, softmax_scale=scale, window_left=kw.get("window_left", -1),
            sinks=None if sinks is None else torch.from_numpy(sinks),
        )  # fmt: skip
        counters = np.zeros(pb.query.shape[0] * hq, np.int64)  # persistent across the two runs
        for land_at_issue in (True, False):
            out, lse, pl = emulate(pbd, scale, sinks=sinks, land_at_issue=land_at_issue,
                                   counters=counters, orders=("ascending", "descending", "random"),
                                   seed=len(q_lens), **kw)  # fmt: skip
            assert not np.isnan(out).any() and not np.isnan(lse).any(), "unwritten output"
            err = np.abs(out - ref.numpy()).max()
            fin = np.isfinite(ref_lse.numpy())
            assert (np.isfinite(lse) == fin).all(), "lse -inf pattern"
            lerr = np.abs(lse[fin] - ref_lse.numpy()[fin]).max() if fin.any() else 0.0
            keys = ("block_m", "block_n", "wg", "q_tile_ctas", "max_splits", "cluster",
                    "cluster_count")  # fmt: skip
            cfg = {k: pl[k] for k in keys}
            kw_s = {k: ("f" if callable(v) else v) for k, v in kw.items()}
            print(f"q={q_lens} kv={kv_lens} {hq}/{hkv}x{d} bs={bs} scale={scale:.3g} {kw_s} "
                  f"land_at_issue={land_at_issue} {cfg}: "
                  f"max|out-ref|={err:.2e} max|lse-ref|={lerr:.2e}")  # fmt: skip
            assert err < 2e-2 and lerr < 1e-3, "emulated kernel disagrees with the reference"
    assert STATS["level2_merges"] > 0, "no case reached the cluster merge's second level"


if __name__ == "__main__":
    main()
