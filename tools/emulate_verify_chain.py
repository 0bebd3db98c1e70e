"""CTA-level numpy emulation of the CUDA verify_chain kernels (csrc/cuda/verify_chain*.cu), for
checking their index math and selection logic without a GPU.

It mirrors the kernels' data flow, not their lanes: the launch plan (splits per row, CTAs per
request), row_stats' split partition (stream_split: every warp of a split takes a contiguous
chunk of the split's 16-byte body vectors (chunk_range), lane-strided; the unaligned head goes to
warp 0 of split 0, the tail to the last warp of the last split; each thread's elements in order),
the per-thread argmax / online normaliser, the per-warp merge (warp_mzi's shuffle tree, whose
(m, z) is the chunk mass record chunk_mz of random rows) and the merge over the warps, the top-k
candidate bound (the min over warps of each warp's ceil(k / 8)-th largest thread maximum, or
the exact k-th largest where streamed rows have splits of >= 8192 logits),
row_filter's candidate bound, candidate collection (capacity, overflow fallback), the radix
selections exactly as written (11/11/10-bit digits, whole-bucket and single-element early exits,
the floor at the candidate bound), decide_sample's acceptance chain and its inverse-CDF
sampling, and the fused path's work queue (item mapping, ordering, an event simulation of its
counters). Sampling takes one of two paths, as in the kernels:

* chunk sampling (the default without top_k/top_p, draft_probs and exponentials; one CTA per
  request): level 1, the chunk masses float(z_c * fast_weight(m_c, m log2 e)) from row_stats'
  chunk_mz, the excluded draft's chunk less the draft's weight (subtracted when that keeps at
  least half of the chunk's mass, else summed without it), the chunk and the target inside it by
  pick_mass (per-thread segments, exclusive scan, the owner search with its fallbacks); level 2,
  the chunk's per-thread contiguous shares of 8-token groups from lo & ~7 (float32 running sums,
  weights 0 outside the chunk), the owner share by the same search and the token by walking it;
* tiled (everything else, and every row with --tiled, as PEAGLE_VERIFY_CHUNKS=0): fp64 tile
  masses of the whole row from float32 per-thread sums, the tile and owner search with its
  fallbacks, then the token inside the tile.

MUFU.EX2 is modelled by float32 exp2 (its 2^-22 error is far inside the tests' slack).

Each case is compared with the CPU op (torch.ops.peagle.verify_chain on CPU): rows may differ
only where the fp64 reference says a decision is within rounding of flipping (the tests' rule);
cases where chunk sampling applies are also run through the tiled path, with the same rule.
Also checked: warp w of split s streams exactly the tokens [lo, hi) of chunk_range's chunk
s * 8 + w, and the chunks tile the row in order; every chunk mass is the exact sum of its
tokens' weights within float rounding; the tiled path's sampled token is the exact fp64
inverse-CDF answer on the same weights or a neighbour within rounding of the target; the chunk
path's chunk and token are the exact fp64 inverse-CDF answers on the chunk masses and on the
chunk's weights (or neighbours within rounding), and its token lies within the chunk masses'
rounding of the exact answer over the whole row.

    python tools/emulate_verify_chain.py            # random cases, prints a summary
    python tools/emulate_verify_chain.py --tiled [N]   # the tiled path everywhere
                                                    # (PEAGLE_VERIFY_CHUNKS=0)
    python tools/emulate_verify_chain.py --topk-in-stats [N]   # the PEAGLE_VERIFY_TOPK_IN_STATS
                                                    # candidate path vs the full path
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from reference import philox as rph  # noqa: E402

import peagle  # noqa: E402,F401

THREADS = 256
WARP = 32
WARPS = THREADS // WARP
CAND_CAP = 4096
MIN_STATS_ELEMS = 4096
STATS_TOPK = 64  # PEAGLE_VERIFY_TOPK_IN_STATS: kStatsTopK, kThreadTop, kStatsCandCap
THREAD_TOP = 4
STATS_CAND_CAP = 128
SMS = 132
SAMPLE_CTAS_PER_SM = 3  # kSampleCtasPerSm: decide_sample residency (heuristics sample_ctas)
LOG2E = np.float32(1.4426950408889634)
MASS_SCALE = 4294967296.0
F32 = np.float32
NEG_INF = F32(-np.inf)


# ---------------------------------------------------------------------------------------------
# scalar helpers (float32 like the kernels)
# ---------------------------------------------------------------------------------------------


def ordered_key(f) -> np.ndarray:
    bits = np.asarray(f, dtype=np.float32).view(np.uint32).astype(np.uint64)
    key = np.where(bits & 0x80000000, (~bits) & 0xFFFFFFFF, bits | 0x80000000)
    return key.astype(np.uint64)


def score_key(s) -> np.ndarray:
    return ordered_key(np.asarray(s, dtype=np.float32) + F32(0.0))


def key_to_float(key) -> np.ndarray:
    key = np.asarray(key, dtype=np.uint64)
    bits = np.where(key & 0x80000000, key & 0x7FFFFFFF, (~key) & 0xFFFFFFFF)
    return bits.astype(np.uint32).view(np.float32)


def ex2(x):
    with np.errstate(over="ignore", invalid="ignore"):
        return np.exp2(np.asarray(x, dtype=np.float32)).astype(np.float32)


def fast_weight(s, ml):
    s = np.asarray(s, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        t = (s.astype(np.float64) * float(LOG2E) - float(ml)).astype(np.float32)
    t = np.where(np.isnan(t), NEG_INF, t)
    return ex2(t)


def fixed_mass(e) -> np.ndarray:
    e = np.asarray(e, dtype=np.float32)
    out = np.where(e > 0, np.rint(e.astype(np.float64) * MASS_SCALE), 0.0)
    return out.astype(np.uint64)


def weight_of(s, m) -> np.float32:
    with np.errstate(invalid="ignore", over="ignore"):
        return F32(np.exp(F32(s) - F32(m)))


def merge_mzi(a: tuple, b: tuple) -> tuple:
    """merge_mzi: (m, z, idx) of two partials, z rescaled to the merged max with precise expf
    (argmax_merge: larger value, ties to the lower index; idx < 0 is empty)."""
    if b[2] < 0:
        am, ai = a[0], a[2]
    elif a[2] < 0 or b[0] > a[0] or (b[0] == a[0] and b[2] < a[2]):
        am, ai = b[0], b[2]
    else:
        am, ai = a[0], a[2]
    m = NEG_INF if ai < 0 else am
    z = F32(0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        for pm, pz, pidx in (a, b):
            if pidx >= 0:
                z = F32(z + (pz if pm == m else F32(pz * np.exp(F32(pm - m)))))
    return (m, z, ai)


def warp_mzi(lanes: list) -> tuple:
    """warp_mzi: lane 0's result of the shuffle-down tree over 32 lanes (at distance d, lane i
    merges lane i + d; lane 0 depends only on lanes i < d at each step, never on a shuffle from
    past the warp)."""
    a = list(lanes)
    d = WARP // 2
    while d > 0:
        a = [merge_mzi(a[i], a[i + d]) for i in range(d)]
        d //= 2
    return a[0]


def seq_sum(values) -> float:
    """fp64 sum in index order (one thread's loop)."""
    acc = 0.0
    for v in values:
        acc += float(v)
    return acc


def cdf_near(cum: np.ndarray, w: np.ndarray, got: int, t: float, tol: float) -> bool:
    """Token `got` has weight and its cumulative-weight interval [cum[got] - w[got], cum[got])
    holds t up to `tol`: the exact inverse-CDF answer (first index with cum > t), or a neighbour
    where t is within `tol` of the boundary between them."""
    if not (0 <= got < len(w) and w[got] > 0):
        return False
    return cum[got] - float(w[got]) - tol <= t < cum[got] + tol


# ---------------------------------------------------------------------------------------------
# the emulated op
# ---------------------------------------------------------------------------------------------


class Emu:
    def __init__(
        self,
        case: dict,
        max_n: int,
        misalign: int = 0,
        min_stats_elems: int = MIN_STATS_ELEMS,
        tile_threads: int = THREADS,
        topk_in_stats: bool = False,
        chunks: bool = True,
    ):
        """``misalign``: elements between an aligned base and row 0 (emulates the row addresses;
        rows are ``V`` elements apart unless the logits are a strided view). Smaller
        ``min_*`` than the kernels' constants give more splits on small vocabularies, and fewer
        ``tile_threads`` (threads of an inverse-CDF tile and of its level-B search, and of the
        chunk path's chunk search and chunk shares; 256 in the kernel) more tiles, each thread
        owning several tiles, chunks or 8-token groups (the index math is the same).
        ``chunks`` False: the tiled path everywhere (PEAGLE_VERIFY_CHUNKS=0)."""
        self.c = case
        lg = case["target_logits"]
        self.dtype = lg.dtype
        self.es = 4 if lg.dtype == torch.float32 else 2
        self.x = lg.float().numpy().astype(np.float32)  # exact for bf16/fp16
        self.R, self.V = self.x.shape
        self.row_stride = lg.stride(0)
        self.misalign = misalign
        self.cu = case["cu_num_draft_tokens"].numpy().astype(np.int64)
        self.B = len(self.cu)
        self.T = int(case["draft_token_ids"].shape[0])
        self.drafts = case["draft_token_ids"].numpy()
        self.temp = case["temperature"].numpy().astype(np.float32)
        self.top_k = case["top_k"].numpy() if case["top_k"] is not None else None
        self.top_p = case["top_p"].numpy().astype(np.float32) if case["top_p"] is not None else None
        self.q = (
            case["draft_probs"].numpy().astype(np.float32)
            if case["draft_probs"] is not None
            else None
        )
        self.u = case["uniforms"].numpy() if case["uniforms"] is not None else None
        self.mask = case["request_mask"].numpy() if case["request_mask"] is not None else None
        self.bonus = (
            case["bonus_token_ids"].numpy() if case["bonus_token_ids"] is not None else None
        )
        self.E = (
            case["exponentials"].numpy().astype(np.float32)
            if case["exponentials"] is not None
            else None
        )
        self.seeds = case["seeds"].numpy()
        self.offsets = case["offsets"].numpy()
        self.max_n = max_n
        b = max(self.B, 1)
        rows = max(self.R, 1)
        elems_cap = max(1, -(-self.V // min_stats_elems))
        self.nsplit = int(min(max(1, -(-8 * SMS // rows)), elems_cap))
        # verify_chain_heuristics::use_filter_groups / use_exact_bound: rows whose warps' chunks
        # hold < 512 vectors are streamed by row_filter; those with splits of >= 8192 logits take
        # the exact k-th largest thread maximum as the top-k bound, the rest the per-warp one
        # (the 8192 scales with min_stats_elems, so that small vocabularies take both bounds).
        epv = 4 if self.dtype == torch.float32 else 8
        split_vecs = -(-(self.V // epv) // self.nsplit)
        chunk_vecs = -(-split_vecs // WARPS)
        exact_elems = 2 * min_stats_elems
        self.exact_bound = chunk_vecs < WARP * 16 and -(-self.V // self.nsplit) >= exact_elems
        self.exact_bound_rows = 0  # top-k rows bounded by the exact k-th largest thread maximum
        self.tile_threads = tile_threads
        tiles = -(-self.V // (8 * tile_threads))
        # plan(): chunk sampling without top_k / top_p, draft_probs and exponentials tensors
        # (emulated wherever it applies, as PEAGLE_VERIFY_CHUNKS=1; the kernels' default takes it
        # from 32 requests: verify_chain_heuristics::use_chunks); then one decide_sample CTA per
        # request, else heuristics sample_ctas.
        self.chunks = (
            chunks
            and case["top_k"] is None
            and case["top_p"] is None
            and self.q is None
            and self.E is None
        )
        self.nsample = (
            1 if self.chunks else int(min(max(1, (SAMPLE_CTAS_PER_SM * SMS) // b), tiles))
        )
        self.cand_cap = int(min(CAND_CAP, max(32, (64 << 20) // 4 // rows)))
        self.topk_in_stats = topk_in_stats
        self.stats = {}
        self.skip_checks = 0
        self.cdf_neighbours = 0
        self.chunk_mz = {}  # row -> [(m, z)] per chunk (random rows with chunk sampling)
        self.chunk_samples = self.chunk_picked_excluded = 0
        self.chunk_excluded = self.chunk_summed = 0  # excluded chunks: subtracted / summed
        self.chunk_max_rel = 0.0  # largest |chunk mass - exact chunk sum| / exact row sum
        self.no_arrival = set()  # requests whose chunk sampling returned before arrive_last

    # -- requests ---------------------------------------------------------------------------------
    def span(self, r):
        lo = min(max(int(self.cu[r - 1]), 0), self.T) if r > 0 else 0
        hi = min(max(int(self.cu[r]), lo), self.T)
        return lo, hi - lo, lo + r

    def request_of_row(self, row):  # the 32-ary warp search
        lo, hi = 0, self.B - 1
        while lo < hi:
            span = hi - lo
            probes = [lo + ((lane + 1) * span + 31) // 32 for lane in range(32)]
            ok = [self.span(pr)[2] <= row for pr in probes]
            if not any(ok):
                hi = probes[0] - 1
            else:
                last = max(i for i in range(32) if ok[i])
                lo = probes[last]
                if last < 31:
                    hi = probes[last + 1] - 1
        return lo

    def real(self, r):
        return self.mask is None or bool(self.mask[r])

    def top_k_active(self, r):
        return self.top_k is not None and 0 < int(self.top_k[r]) < self.V

    def top_p_active(self, r):
        return self.top_p is not None and not self.top_p[r] >= 1.0

    def row_info(self, row):
        r = self.request_of_row(row)
        first_draft, n_r, first_row = self.span(r)
        j = row - first_row
        bonus_row = j == n_r
        info = {"r": r, "mode": "skip", "inv_t": F32(1.0)}
        if not self.real(r) or (bonus_row and self.bonus is not None):
            return info
        if not bonus_row and j >= self.max_n:
            return info
        t = self.temp[r]
        if not t > 0:
            info["mode"] = "greedy"
            return info
        filt = self.top_k_active(r) or self.top_p_active(r)
        info["mode"] = "filtered" if filt else "random"
        info["inv_t"] = F32(1.0) / t
        return info

    # -- kernel 1: row_stats ----------------------------------------------------------------------
    def row_body(self, row):
        """row_body: (head scalars before the first 16-byte boundary, 16-byte vectors, body end)."""
        epv = 16 // self.es
        addr = (self.misalign + row * self.row_stride) * self.es
        head = min(((16 - addr % 16) % 16) // self.es, self.V)
        nvec = (self.V - head) // epv
        return head, nvec, head + nvec * epv

    def chunk_range(self, row, split, nsplit, warp):
        """chunk_range: chunk split * 8 + warp of a row as tokens [lo, hi) and body vectors
        [vb, ve) (int64 floor divisions); chunk 0 also holds the head, the last one the tail."""
        head, nvec, _ = self.row_body(row)
        epv = 16 // self.es
        sb = nvec * split // nsplit
        n = nvec * (split + 1) // nsplit - sb
        vb = sb + n * warp // WARPS
        ve = sb + n * (warp + 1) // WARPS
        lo = 0 if split == 0 and warp == 0 else head + vb * epv
        hi = self.V if split == nsplit - 1 and warp == WARPS - 1 else head + ve * epv
        return lo, hi, vb, ve

    def thread_elements(self, row, split, nsplit):
        """Element indices per thread, in each thread's processing order, grouped as the
        kernel's callback calls (stream_split: warp 0 of split 0 takes the head scalars, warp w
        the body vectors [vb, ve) of its chunk lane-strided, the last warp of the last split the
        tail scalars). Checks that every warp streams exactly its chunk's tokens."""
        head, nvec, body_end = self.row_body(row)
        epv = 16 // self.es
        calls = [[] for _ in range(THREADS)]
        for w in range(WARPS):
            lo, hi, vb, ve = self.chunk_range(row, split, nsplit, w)
            t0 = w * WARP
            if split == 0 and w == 0:
                for v in range(head):
                    calls[t0 + v % WARP].append([v])
            for i in range(vb, ve):
                calls[t0 + (i - vb) % WARP].append(
                    list(range(head + i * epv, head + (i + 1) * epv))
                )
            if split == nsplit - 1 and w == WARPS - 1:
                for v in range(body_end, self.V):
                    calls[t0 + (v - body_end) % WARP].append([v])
            seen = sorted(v for t in range(t0, t0 + WARP) for vec in calls[t] for v in vec)
            assert seen == list(range(lo, hi)), f"row {row} chunk ({split}, {w}): [{lo}, {hi})"
            for t in range(t0, t0 + WARP):
                flat = [v for vec in calls[t] for v in vec]
                assert flat == sorted(flat), f"row {row} thread {t}: out of order"
        return calls

    def check_chunks_tile(self, row):
        """The chunks of a row tile [0, V) in order (chunk_range's claim)."""
        ends = [self.chunk_range(row, c // WARPS, self.nsplit, c % WARPS)[:2]
                for c in range(self.nsplit * WARPS)]  # fmt: skip
        assert ends[0][0] == 0 and ends[-1][1] == self.V, (row, ends[0], ends[-1])
        for (lo0, hi0), (lo1, hi1) in zip(ends[:-1], ends[1:], strict=True):
            assert lo0 <= hi0 == lo1 <= hi1, (row, (lo0, hi0), (lo1, hi1))
        return ends

    def row_stats(self, row, split, info):
        calls = self.thread_elements(row, split, self.nsplit)
        x = self.x[row]
        per_thread = []
        for t in range(THREADS):
            bval, z, ml, bidx = NEG_INF, F32(0.0), NEG_INF, -1
            for vec in calls[t]:
                if info["mode"] == "greedy":
                    vk = -1
                    for k, v in enumerate(vec):
                        if x[v] > bval:
                            bval, vk = x[v], k
                    if vk >= 0:
                        bidx = vec[0] + vk
                    continue
                s = (x[vec] * info["inv_t"]).astype(np.float32)
                vm, vk = bval, -1
                for k in range(len(vec)):
                    if s[k] > vm:
                        vm, vk = s[k], k
                if vk >= 0:
                    z = F32(z * ex2((bval - vm) * LOG2E)) if bval > NEG_INF else F32(0.0)
                    bval, bidx, ml = vm, vec[0] + vk, F32(vm * LOG2E)
                z = F32(z + fast_weight(s, ml).sum(dtype=np.float32))
            per_thread.append((bval, z, bidx))
        if self.stats_cands_row(info):
            self.topk_meta[row][split] = self.stats_cands(row, split, info, calls)
        # Per warp: warp_mzi's shuffle tree (greedy rows: the argmax with z = 0, the same tree
        # gives the first index of the maximum); random rows with chunk sampling record every
        # warp's (m, z) as chunk_mz[row, split * 8 + warp]. Then thread 0 merges the 8 warps in
        # order.
        warps = []
        for w in range(WARPS):
            lanes = [(bv, F32(0.0) if info["mode"] == "greedy" else zt, bi)
                     for bv, zt, bi in per_thread[w * WARP : (w + 1) * WARP]]  # fmt: skip
            a = warp_mzi(lanes)
            warps.append(a)
            if self.chunks and info["mode"] == "random":
                mz = self.chunk_mz.setdefault(row, [None] * (self.nsplit * WARPS))
                mz[split * WARPS + w] = (NEG_INF if a[2] < 0 else a[0], a[1])
        tot = warps[0]
        for a in warps[1:]:
            tot = merge_mzi(tot, a)
        m, z, idx = tot
        bound = NEG_INF
        r = info["r"]
        if info["mode"] == "filtered" and self.top_k_active(r) and int(self.top_k[r]) <= THREADS:
            maxima = np.array([pt[0] for pt in per_thread], dtype=np.float32)
            if self.exact_bound:  # the top_k-th largest of all thread maxima
                bound = np.sort(maxima)[::-1][int(self.top_k[r]) - 1]
                self.exact_bound_rows += 1
            else:  # min over warps of each warp's ceil(k / 8)-th largest thread maximum
                rank = -(-int(self.top_k[r]) // WARPS)
                per_warp = [np.sort(maxima[w * WARP : (w + 1) * WARP])[::-1][rank - 1]
                            for w in range(WARPS)]  # fmt: skip
                bound = min(per_warp)
        return (m if idx >= 0 else NEG_INF, z, idx, bound)

    def stats_cands_row(self, info):
        r = info["r"]
        return (
            self.topk_in_stats
            and info["mode"] == "filtered"
            and self.top_k_active(r)
            and int(self.top_k[r]) <= STATS_TOPK
        )

    def stats_cands(self, row, split, info, calls):
        """row_stats<D, true>'s candidates of one split: (keys written, n or None on overflow,
        inclusive bound key). Per thread, the kThreadTop largest sanitized scores (the branchless
        insertion keeps exactly that multiset) and the number of elements seen."""
        x = self.x[row]
        k = int(self.top_k[info["r"]])
        lists, ub = [], 0
        for t in range(THREADS):
            idx = [v for vec in calls[t] for v in vec]
            s = (x[idx] * info["inv_t"]).astype(np.float32)
            s = np.where(np.isnan(s), NEG_INF, s).astype(np.float32)
            top = np.sort(s)[::-1][:THREAD_TOP]
            if len(idx) > THREAD_TOP:
                ub = max(ub, int(score_key(top[-1])) + 1)
            lists.append(score_key(top))
        keys = np.concatenate(lists) if lists else np.zeros(0, dtype=np.uint32)
        keys = keys[keys >= ub]
        bound = ub
        if len(keys) >= k:  # 4 levels of 8-bit digits
            prefix, pmask, left = 0, 0, k
            for level in range(4):
                shift = 24 - 8 * level
                sel = keys[(keys & pmask) == prefix]
                cnt = np.bincount(((sel >> shift) & 255).astype(np.int64), minlength=256)
                d, above = self.find_digit_count(cnt, left)
                d = max(d, 0)
                left -= above
                prefix |= d << shift
                pmask |= 255 << shift
                if cnt[d] == left:
                    break
            bound = max(bound, prefix)
        out = keys[keys >= bound]
        n = len(out) if len(out) <= STATS_CAND_CAP else None
        return out, n, bound

    def merge_row(self, row):
        parts = self.parts[row]
        m, idx, z, bound = NEG_INF, -1, F32(0.0), NEG_INF
        for pm, _, pidx, pb in parts:
            bound = max(bound, pb)
            if pidx >= 0 and (pm > m or (pm == m and pidx < idx)):
                m, idx = pm, pidx
        for pm, pz, pidx, _ in parts:
            if pidx >= 0:
                z = F32(z + pz * np.exp(np.float32(pm - m)))
        return (m if idx >= 0 else NEG_INF), z, idx, bound

    # -- kernel 2: row_filter ---------------------------------------------------------------------
    @staticmethod
    def find_digit_count(cnt, rank):
        cum = 0
        for b in range(len(cnt) - 1, -1, -1):
            c = int(cnt[b])
            if cum < rank <= cum + c:
                return b, cum
            cum += c
        return -1, 0

    @staticmethod
    def find_digit_mass(cnt, mass, target, above):
        cum = 0
        found, found_above = -1, 0
        for b in range(len(cnt) - 1, -1, -1):
            if cnt[b] > 0 and float(above + cum) < target:
                found, found_above = b, cum
            cum += int(mass[b])
        return found, found_above

    def radix_kth_key(self, keys, rank):
        prefix, pmask, left = 0, 0, rank
        for shift, bits in ((21, 11), (10, 11), (0, 10)):
            bins = 1 << bits
            dmask = bins - 1
            sel = keys[(keys & pmask) == prefix]
            cnt = np.bincount(((sel >> shift) & dmask).astype(np.int64), minlength=bins)
            d, above = self.find_digit_count(cnt, left)
            d = max(d, 0)
            left -= above
            prefix |= d << shift
            pmask |= dmask << shift
            if cnt[d] == left:
                break
        return prefix

    def radix_top_p(self, keys, scores, kk, ml, top_p, target):
        prefix, pmask, above, z_fixed = 0, 0, 0, 0
        masses = fixed_mass(fast_weight(scores, ml)).astype(np.uint64)
        for level, (shift, bits) in enumerate(((21, 11), (10, 11), (0, 10))):
            bins = 1 << bits
            dmask = bins - 1
            selm = (keys >= kk) & ((keys & pmask) == prefix)
            digits = ((keys[selm] >> shift) & dmask).astype(np.int64)
            cnt = np.bincount(digits, minlength=bins)
            mass = np.zeros(bins, dtype=np.uint64)
            np.add.at(mass, digits, masses[selm])
            if level == 0 and target < 0:
                target = float(top_p) * float(int(mass.sum(dtype=np.uint64)))
            d, higher = self.find_digit_mass(cnt, [int(v) for v in mass], target, above)
            if d < 0:
                d = bins - 1
            above += higher
            prefix |= d << shift
            pmask |= dmask << shift
            single = cnt[d] <= 1
            z_fixed = above + int(mass[d])
            if single:
                break
        return max(prefix, kk), z_fixed

    def select(self, keys, scores, num_elems, complete, r, ml, zf):
        topk, topp = self.top_k_active(r), self.top_p_active(r)
        kk = self.radix_kth_key(keys, int(self.top_k[r])) if topk else 0
        masses = fixed_mass(fast_weight(scores, ml)).astype(np.uint64)
        if not topp:
            return True, kk, int(masses[keys >= kk].sum(dtype=np.uint64))
        target = -1.0
        if not topk and not complete:
            target = float(self.top_p[r]) * float(zf) * MASS_SCALE
            if float(int(masses.sum(dtype=np.uint64))) < target and num_elems < self.V:
                return False, 0, 0
        key, z = self.radix_top_p(keys, scores, kk, ml, self.top_p[r], target)
        return True, key, z

    def row_filter(self, row, info):
        full = self.row_filter_full(row, info)
        if not self.stats_cands_row(info):
            return full
        r = info["r"]
        k = int(self.top_k[r])
        metas = [self.topk_meta[row][sp] for sp in range(self.nsplit)]
        t = max(b for _, _, b in metas)
        ntot = sum(n for _, n, _ in metas if n is not None)
        bad = any(n is None for _, n, _ in metas)
        has_full = any(n is not None and b == t and n >= k for _, n, b in metas)
        if bad or not has_full or ntot > CAND_CAP:
            self.filter_paths[-1] = "stats-fallback/" + self.filter_paths[-1]
            return full
        keys = np.concatenate([c for c, _, _ in metas])
        keys = keys[keys >= t]
        m, zf, idx, _ = self.merge_row(row)
        ml = F32(m * LOG2E)
        _, key, z = self.select(keys, key_to_float(keys), len(keys), True, r, ml, zf)
        key = max(key, t)
        # The same kept set and mass as the full path (its key may be another bucket floor).
        s_all = (self.x[row] * info["inv_t"]).astype(np.float32)
        s_all = np.where(np.isnan(s_all), NEG_INF, s_all).astype(np.float32)
        keys_all = score_key(s_all)
        assert np.array_equal(keys_all >= key, keys_all >= full["key"]), (row, key, full["key"])
        assert z / MASS_SCALE == full["z"], (row, z, full["z"])
        self.filter_paths[-1] = "stats"
        self.stats_threshold_checks += 1
        return {"m": m, "key": key, "z": z / MASS_SCALE, "first_max": max(idx, 0)}

    def row_filter_full(self, row, info):
        r = info["r"]
        m, zf, idx, bound = self.merge_row(row)
        ml = F32(m * LOG2E)
        if self.top_k_active(r):
            t = bound
        else:
            denom = F32((F32(1.0) - self.top_p[r]) * zf)
            t = F32(m - (F32(np.log(F32(self.V) / denom)) + F32(0.05))) if denom > 0 else NEG_INF
        if not t > NEG_INF:
            t = NEG_INF
        key_t = int(score_key(t))
        s_all = (self.x[row] * info["inv_t"]).astype(np.float32)
        s_all = np.where(np.isnan(s_all), NEG_INF, s_all).astype(np.float32)
        keys_all = score_key(s_all)
        cand = keys_all >= key_t
        total = int(cand.sum())
        complete = t == NEG_INF
        ok = total <= self.cand_cap and not (self.top_k_active(r) and total < int(self.top_k[r]))
        self.filter_paths.append("candidates" if ok else "fallback")
        key = z = 0
        if ok:
            keys = keys_all[cand]
            ok, key, z = self.select(keys, key_to_float(keys), total, complete, r, ml, zf)
            key = max(key, key_t)
            if not ok:
                self.filter_paths[-1] = "unresolved"
        if not ok:
            _, key, z = self.select(keys_all, s_all, self.V, True, r, ml, zf)
        return {"m": m, "key": key, "z": z / MASS_SCALE, "first_max": max(idx, 0)}

    # -- kernel 3: decide_sample ------------------------------------------------------------------
    def row_dist(self, row, filtered):
        if filtered:
            return self.stats[row]
        m, z, idx, _ = self.merge_row(row)
        return {"m": m, "key": 0, "z": float(z), "first_max": max(idx, 0)}

    def sample(self, r, dec):
        row, exclude, key, m, zf = dec["row"], dec["exclude"], dec["key"], dec["m"], F32(dec["z"])
        inv_t = F32(1.0) / self.temp[r]
        seed, offset = int(self.seeds[r]), int(self.offsets[r])
        stream = rph.STREAM_BONUS if dec["mode"] == "bonus" else rph.STREAM_RECOVERED
        qrow = self.q[dec["q_row"]] if dec["q_row"] >= 0 else None
        s_all = (self.x[row] * inv_t).astype(np.float32)
        s_all = np.where(np.isnan(s_all), NEG_INF, s_all).astype(np.float32)
        kept = score_key(s_all) >= key
        if dec["mode"] == "recovered" and self.E is not None:
            best = (NEG_INF, -1)
            for v in range(self.V):
                pv = F32(weight_of(s_all[v], m) / zf) if kept[v] else F32(0.0)
                res = F32(pv - qrow[v]) if qrow is not None else (F32(0.0) if v == exclude else pv)
                if res > 0:
                    val = F32(res / self.E[r, v])
                    if val > best[0] or (val == best[0] and v < best[1]):
                        best = (val, v)
            return best[1] if best[1] >= 0 else dec["first_max"]
        # Token weights (float32 like the kernel's weights_of).
        ml = F32(m * LOG2E)
        w = np.zeros(self.V, dtype=np.float32)
        for v in range(self.V):
            e = fast_weight(s_all[v], ml) if kept[v] else F32(0.0)
            if qrow is None:
                w[v] = e if (kept[v] and v != exclude) else F32(0.0)
            else:
                res = F32(F32(e / zf) - F32(qrow[v]))
                w[v] = res if res > 0 else F32(0.0)
        u = rph.sampling_uniform(seed, offset, stream)
        if self.chunks:
            return self.sample_chunked(r, dec, w, ml, u)
        lvl = self.tile_masses(w, 0, self.V)
        pick = self.pick_mass(lvl["mass"], u=u)
        if pick is None:
            return dec["first_max"]
        tile, t_rem, total, t = pick
        got = self.pick_in_tile(lvl, tile, t_rem)
        # Exact answer (fp64 cumulative over the same float32 weights): only a rounding-level
        # neighbour may differ.
        cum = np.cumsum(w.astype(np.float64))
        self.skip_checks += 1
        if not cdf_near(cum, w, got, t, 0.0):
            self.cdf_neighbours += 1
            exact = int(np.searchsorted(cum, t, side="right"))
            assert cdf_near(cum, w, got, t, 1e-9 * total), (
                f"inverse CDF picked {got}, exact {exact}"
            )
        return got

    # -- inverse-CDF building blocks (tile_masses, pick_mass, cdf_pick) ---------------------------
    def tile_masses(self, w, lo, hi):
        """tile_masses over tokens [lo, hi) of a row (weights 0 outside): tiles of 8 * nt tokens
        from base = lo & ~7, thread i of a tile owning tokens [8i, 8i + 8). Returns the per-thread
        float32 sums and running sums, their fp64 exclusive prefix within the tile, and the fp64
        tile masses (the kernel reduces each tile's thread sums by a warp shuffle tree and then
        over the warps in order: the same sum up to fp64 rounding)."""
        nt = self.tile_threads
        tile_len = 8 * nt
        base = lo & ~7
        ntiles = -(-(hi - base) // tile_len) if hi > lo else 0
        wp = np.zeros(ntiles * tile_len, dtype=np.float32)
        wp[lo - base : hi - base] = w[lo:hi]
        thread_w = wp.reshape(ntiles, nt, 8)
        thread_sum = np.zeros((ntiles, nt), dtype=np.float32)
        thread_part = np.zeros((ntiles, nt, 8), dtype=np.float32)
        for k in range(8):  # sequential float32 sums, as each thread adds its 8 weights
            thread_sum = (thread_sum + thread_w[:, :, k]).astype(np.float32)
            thread_part[:, :, k] = thread_sum
        excl_t = np.zeros((ntiles, nt))
        mass = np.zeros(ntiles)
        for c in range(ntiles):
            acc = 0.0
            for i in range(nt):
                excl_t[c, i] = acc
                acc += float(thread_sum[c, i])
            mass[c] = acc
        return {"base": base, "lo": lo, "hi": hi, "w": thread_w, "sum": thread_sum,
                "part": thread_part, "excl": excl_t, "mass": mass}  # fmt: skip

    def pick_mass(self, mass, t=None, u=None):
        """pick_mass over masses mass[0..n) with nt threads: thread i sums its contiguous segment
        of ceil(n / nt) indices in order, an exclusive scan over the threads (fp64); the target
        is t, or u * total. The first owner whose excl + seg > t walks its segment to the first
        index whose running sum passes t (t_rem = the target inside it); with no such owner, the
        highest owner with mass and its last index with mass, t_rem = +inf. None if the total is
        not > 0; else (index, t_rem, total, t)."""
        nt = self.tile_threads
        n = len(mass)
        per = -(-n // nt)
        segs = [(min(n, per * i), min(n, per * i + per)) for i in range(nt)]
        seg = [seq_sum(mass[c0:c1]) for c0, c1 in segs]
        excl, acc = [], 0.0
        for v in seg:
            excl.append(acc)
            acc += v
        total = acc
        if not total > 0:
            return None
        if t is None:
            t = u * total
        first = [i for i in range(nt) if seg[i] > 0 and excl[i] + seg[i] > t]
        o = first[0] if first else max(i for i in range(nt) if seg[i] > 0)
        part, idx, t_rem = 0.0, -1, math.inf
        for c in range(*segs[o]):
            if not mass[c] > 0:
                continue
            before, part, idx = part, part + float(mass[c]), c
            if first and excl[o] + part > t:
                t_rem = t - (excl[o] + before)
                break
        return idx, (t_rem if first else math.inf), total, t

    def pick_in_tile(self, lvl, tile, t_rem):
        """cdf_pick's last step: the owner thread inside the tile (first whose prefix + own sum
        passes t_rem, else the highest with weight), then its first token whose running sum
        passes t_rem, else its last token with weight. Returns the token id."""
        nt = self.tile_threads
        ts = lvl["sum"][tile].astype(np.float64)
        ex = lvl["excl"][tile]
        first = [i for i in range(nt) if ts[i] > 0 and ex[i] + ts[i] > t_rem]
        o2 = first[0] if first else max(i for i in range(nt) if ts[i] > 0)
        v0 = lvl["base"] + tile * 8 * nt + 8 * o2
        tok = last = -1
        for k in range(8):
            if lvl["w"][tile, o2, k] > 0:
                last = v0 + k
                if tok < 0 and ex[o2] + float(lvl["part"][tile, o2, k]) > t_rem:
                    tok = last
        got = tok if tok >= 0 else last
        assert lvl["lo"] <= got < lvl["hi"], (got, lvl["lo"], lvl["hi"])
        return got

    def chunk_share_sums(self, w, lo, hi):
        """chunk_share / share_sum over tokens [lo, hi) (weights 0 outside): 8-token groups from
        base = lo & ~7, thread i a contiguous share of ceil(groups / nt) groups; per thread the
        float32 running sum in token order and the fp64 exclusive scan over the threads."""
        nt = self.tile_threads
        base = lo & ~7
        groups = -(-(hi - base) // 8) if hi > base else 0
        per = -(-groups // nt)
        shares, runs, excl = [], [], []
        acc = 0.0
        for i in range(nt):
            g0 = min(groups, per * i)
            g1 = min(groups, g0 + per)
            v0, v1 = base + 8 * g0, base + 8 * g1
            run = F32(0.0)
            for v in range(v0, v1):
                if lo <= v < hi:
                    run = F32(run + w[v])
            shares.append((v0, v1))
            runs.append(run)
            excl.append(acc)
            acc += float(run)
        return {"lo": lo, "hi": hi, "shares": shares, "run": runs, "excl": excl, "total": acc}

    def sample_chunked(self, r, dec, w, ml, u):
        """sample_chunked (one CTA per request). Level 1: the chunk masses est_c =
        float(z_c * fast_weight(m_c, ml)) from chunk_mz; the excluded draft's chunk cx loses
        x's weight ex = fast_weight(score of x, ml): est - ex (float) when ex <= est / 2, else
        cx is summed without x (its shares, reused if it is picked); pick_mass gives the chunk
        and the target inside it. Level 2: the chunk's shares (unless reused), the owner (first
        thread whose excl + run passes the target, else the highest with weight) walks its share
        to the first token whose running sum passes it, else its last token with weight."""
        row, x = dec["row"], dec["exclude"]
        ranges = self.check_chunks_tile(row)
        mz = self.chunk_mz[row]
        self.chunk_samples += 1

        def est(c):
            m_c, z_c = mz[c]
            return F32(z_c * fast_weight(m_c, ml)) if z_c > 0 else F32(0.0)

        cx, wx, ex, lvl_x = -1, 0.0, F32(0.0), None
        if 0 <= x < self.V:
            owners = [c for c, (lo, hi) in enumerate(ranges) if lo <= x < hi]
            assert len(owners) == 1, (row, x, owners)  # "exactly one"
            cx = owners[0]
            e_c, ex = est(cx), fast_weight(dec["exclude_score"], ml)
            if ex <= F32(0.5) * e_c:
                wx = float(F32(e_c - ex))
                self.chunk_excluded += 1  # subtracted
            else:
                lvl_x = self.chunk_share_sums(w, *ranges[cx])
                wx = lvl_x["total"]
                self.chunk_summed += 1
        mass = np.array([wx if c == cx else float(est(c)) for c in range(len(ranges))])
        # Every chunk mass is its tokens' exact weight sum within float rounding (a chunk_range /
        # stream_split mismatch would move whole tokens; thread_elements checks that directly).
        cum = np.cumsum(w.astype(np.float64))
        exact_c = np.array([seq_sum(w[lo:hi].astype(np.float64)) for lo, hi in ranges])
        err = np.abs(mass - exact_c)
        scale_c = exact_c.copy()
        if cx >= 0:
            scale_c[cx] += float(ex)  # est - ex: the rounding of est, of a mass with x
        total_w = float(cum[-1]) if self.V else 0.0
        assert np.all(err <= 1e-5 * scale_c + 1e-30), (row, err.max(), exact_c[err.argmax()])
        if total_w > 0:
            self.chunk_max_rel = max(self.chunk_max_rel, float(err.sum()) / total_w)
        pick = self.pick_mass(mass, u=u)
        if pick is None:
            assert not total_w > 1e-30, row
            self.no_arrival.add(r)  # fused path: returns before arrive_last (see report)
            return dec["first_max"]
        c, t_rem, total, t = pick
        assert cdf_near(np.cumsum(mass), mass, c, t, 1e-9 * total), ("chunk", row, c, t)
        if lvl_x is not None and c == cx:
            lvl = lvl_x
            self.chunk_picked_excluded += 1
        else:
            lvl = self.chunk_share_sums(w, *ranges[c])
        lo, hi = ranges[c]
        assert lvl["total"] > 0, ("chunk with mass but no token with weight", row, c)
        runs, excl = lvl["run"], lvl["excl"]
        nt = self.tile_threads
        first = [i for i in range(nt) if runs[i] > 0 and excl[i] + float(runs[i]) > t_rem]
        o = first[0] if first else max(i for i in range(nt) if runs[i] > 0)
        part, tok, last = F32(0.0), -1, -1
        v0, v1 = lvl["shares"][o]
        part_exact, part_err = 0.0, 0.0
        for v in range(v0, v1):
            wv = w[v] if lo <= v < hi else F32(0.0)
            part = F32(part + wv)
            part_exact += float(wv)
            part_err = max(part_err, abs(float(part) - part_exact))
            if wv > 0:
                last = v
                if excl[o] + float(part) > t_rem:
                    tok = v
                    break
        got = tok if tok >= 0 else last
        assert lo <= got < hi, (got, lo, hi)
        # Inside the chunk: the exact inverse-CDF answer on its weights at t_rem within the
        # shares' float32 rounding (or, past the chunk's total, its last token with weight).
        wc = w[lo:hi]
        cum_c = np.cumsum(wc.astype(np.float64))
        exact_runs = [seq_sum(wc[max(a, lo) - lo : max(b, lo) - lo]) for a, b in lvl["shares"]]
        tol_c = sum(abs(float(a) - b) for a, b in zip(runs, exact_runs, strict=True))
        tol_c += part_err + 1e-9 * lvl["total"]
        if t_rem < cum_c[-1] - tol_c:
            assert cdf_near(cum_c, wc, got - lo, t_rem, tol_c), ("token", row, c, got, t_rem)
        elif t_rem >= lvl["total"]:
            assert got == lo + int(np.nonzero(wc > 0)[0][-1]), ("fallback", row, c, got)
        # Over the row: within the masses' and shares' rounding of the exact answer at u * W.
        tol = 2.0 * float(err.sum()) + tol_c + 1e-9 * total_w
        self.skip_checks += 1
        if not cdf_near(cum, w, got, u * total_w, 0.0):
            self.cdf_neighbours += 1
            assert cdf_near(cum, w, got, u * total_w, tol), ("row", row, got, u * total_w, tol)
        return got

    def run(self):
        self.parts = {}
        self.filter_paths = []
        self.topk_meta = {row: {} for row in range(self.R)}
        self.stats_threshold_checks = 0
        infos = {row: self.row_info(row) for row in range(self.R)}
        for row, info in infos.items():
            if info["mode"] != "skip":
                self.parts[row] = [self.row_stats(row, s, info) for s in range(self.nsplit)]
        for row, info in infos.items():
            if info["mode"] == "filtered":
                self.stats[row] = self.row_filter(row, info)
        out = np.full((self.B, self.max_n + 1), -1, dtype=np.int32)
        acc_out = np.zeros(self.B, dtype=np.int32)
        for r in range(self.B):
            if not self.real(r):
                continue
            first_draft, n_r, first_row = self.span(r)
            n = min(n_r, self.max_n)
            t = self.temp[r]
            greedy = not t > 0
            inv_t = F32(1.0) if greedy else F32(1.0) / t
            filtered = not greedy and (self.top_k_active(r) or self.top_p_active(r))
            dec = None
            for j in range(n + 1):
                row = first_row + (j if j < n else n_r)
                if j == n:
                    if self.bonus is not None:
                        dec = {"mode": "done", "acc": n, "last": int(self.bonus[r])}
                    elif greedy:
                        dec = {"mode": "done", "acc": n, "last": max(self.merge_row(row)[2], 0)}
                    else:
                        d = self.row_dist(row, filtered)
                        dec = {"mode": "bonus", "acc": n, "row": row, "exclude": -1,
                               "q_row": -1, **d}  # fmt: skip
                    break
                x = int(self.drafts[first_draft + j])
                if greedy:
                    a = max(self.merge_row(row)[2], 0)
                    if x != a:
                        dec = {"mode": "done", "acc": j, "last": a}
                        break
                    continue
                d = self.row_dist(row, filtered)
                valid = 0 <= x < self.V
                sx = F32(self.x[row, x] * inv_t) if valid else NEG_INF
                p_x = 0.0
                if valid and int(score_key(sx)) >= d["key"]:
                    p_x = float(weight_of(sx, d["m"])) / d["z"]
                q_x = (
                    1.0 if self.q is None else (float(self.q[first_draft + j, x]) if valid else 0.0)
                )
                u = (
                    float(self.u[first_draft + j])
                    if self.u is not None
                    else float(
                        rph.acceptance_uniforms(int(self.seeds[r]), int(self.offsets[r]), j + 1)[j]
                    )
                )
                if p_x > 0 and q_x > 0 and u <= p_x / q_x:
                    continue
                dec = {"mode": "recovered", "acc": j, "row": row,
                       "exclude": x if self.q is None else -1, "exclude_score": sx,
                       "q_row": first_draft + j if self.q is not None else -1, **d}  # fmt: skip
                break
            acc = dec["acc"]
            out[r, :acc] = self.drafts[first_draft : first_draft + acc]
            out[r, acc] = dec["last"] if dec["mode"] == "done" else self.sample(r, dec)
            acc_out[r] = acc
        return out, acc_out


# ---------------------------------------------------------------------------------------------
# the fused path's work queue (fused_kernel in csrc/cuda/verify_chain.cu)
# ---------------------------------------------------------------------------------------------


def fused_plan(emu: Emu, per_sm: int = 4) -> dict:
    """plan()'s fused fields: nsample (1 with chunk sampling, else heuristics sample_ctas), total
    items, grid, lag."""
    rows, reqs = max(emu.R, 1), max(emu.B, 1)
    tiles = -(-emu.V // 2048)
    nsample = 1 if emu.chunks else int(min(max(1, (SAMPLE_CTAS_PER_SM * SMS) // reqs), tiles))
    total = rows * emu.nsplit + reqs * nsample
    grid = min(SMS * per_sm, total)
    per_req = max(1, rows * emu.nsplit // reqs + nsample)
    lag = int(min(max(1, -(-grid // per_req) + 1), reqs))
    return {"nsample": nsample, "total": total, "grid": grid, "lag": lag}


def fused_block_start(emu: Emu, fp: dict, r: int) -> int:
    first_row = emu.span(r)[2] if r < emu.B else emu.R
    return first_row * emu.nsplit + max(0, r - fp["lag"]) * fp["nsample"]


def fused_item(emu: Emu, fp: dict, item: int) -> tuple:
    """fused_item(): ("stats", r, row, split) or ("sample", r, g), with the kernel's search."""
    tail = fused_block_start(emu, fp, emu.B)
    if item >= tail:
        k = item - tail
        return ("sample", max(0, emu.B - fp["lag"]) + k // fp["nsample"], k % fp["nsample"])
    lo, hi = 0, emu.B - 1
    while lo < hi:
        span = hi - lo
        probes = [lo + ((lane + 1) * span + 31) // 32 for lane in range(32)]
        ok = [fused_block_start(emu, fp, pr) <= item for pr in probes]
        if not any(ok):
            hi = probes[0] - 1
        else:
            last = max(i for i in range(32) if ok[i])
            lo = probes[last]
            if last < 31:
                hi = probes[last + 1] - 1
    first_draft, n_r, first_row = emu.span(lo)
    local = item - fused_block_start(emu, fp, lo)
    nstats = (n_r + 1) * emu.nsplit
    if local < nstats:
        return ("stats", lo, first_row + local // emu.nsplit, local % emu.nsplit)
    return ("sample", lo - fp["lag"], local - nstats)


def check_fused_schedule(emu: Emu, rng: np.random.Generator, grid: int | None = None) -> dict:
    """The queue covers every (row, split) and every (request, g) once; a request's sampling
    items follow all its stats items (deadlock freedom); an event simulation of `grid` CTAs
    taking items in order, in random interleavings, the arrival counters, the decided flags
    and their resets, finishes with every counter back at zero. Requests in emu.no_arrival
    (run() first) model sample_chunked's early return on an empty total, which comes before
    its arrive_last: that item neither arrives nor resets the counters."""
    fp = fused_plan(emu)
    if grid is not None:
        fp["grid"] = grid
    items = [fused_item(emu, fp, i) for i in range(fp["total"])]
    stats = sorted((it[2], it[3]) for it in items if it[0] == "stats")
    assert stats == [(row, s) for row in range(emu.R) for s in range(emu.nsplit)], "stats items"
    samp = sorted((it[1], it[2]) for it in items if it[0] == "sample")
    assert samp == [(r, g) for r in range(emu.B) for g in range(fp["nsample"])], "sample items"
    last_stats = {}
    for i, it in enumerate(items):
        if it[0] == "stats":
            last_stats[it[1]] = i
        else:
            assert last_stats.get(it[1], -1) < i, f"sampling item {it} before a stats item"
    # Event simulation (random = sampling requests; the op's decision itself is not needed).
    random_req = [emu.real(r) and emu.temp[r] > 0 for r in range(emu.B)]
    need = {r: (emu.span(r)[1] + 1) * emu.nsplit for r in range(emu.B)}
    stats_arr = dict.fromkeys(range(emu.B), 0)
    samp_arr = dict.fromkeys(range(emu.B), 0)
    decided = dict.fromkeys(range(emu.B), 0)
    nxt = 0
    ctas = [[0, None] for _ in range(fp["grid"])]  # (items done, item held)
    done_ctas = 0
    while done_ctas < len(ctas):
        progressed = False
        for ci in rng.permutation(len(ctas)):  # a random interleaving per round
            c = ctas[ci]
            if c[1] == "exit":
                continue
            if c[1] is None:
                c[1] = nxt
                nxt += 1
                if c[1] >= fp["total"]:
                    c[1] = "exit"
                    done_ctas += 1
                    progressed = True
                    continue
            it = items[c[1]]
            if it[0] == "stats":
                c[0] += 1
                stats_arr[it[1]] += 1
                if stats_arr[it[1]] == need[it[1]]:
                    stats_arr[it[1]] = 0
                    if random_req[it[1]]:
                        decided[it[1]] = 1
                c[1] = None
                progressed = True
            elif not random_req[it[1]]:
                c[1] = None
                progressed = True
            elif decided[it[1]] and it[1] in emu.no_arrival:
                c[1] = None  # sample_chunked: first_max written, no arrive_last
                progressed = True
            elif decided[it[1]]:
                samp_arr[it[1]] += 1
                if samp_arr[it[1]] == fp["nsample"]:
                    samp_arr[it[1]] = 0
                    decided[it[1]] = 0
                c[1] = None
                progressed = True
        assert progressed, "fused queue deadlocked"
    left = {r: (stats_arr[r], samp_arr[r], decided[r]) for r in range(emu.B)
            if stats_arr[r] or samp_arr[r] or decided[r]}  # fmt: skip
    assert not left, f"fused counters left set (stats, sample arrivals, decided): {left}"
    return fp


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------


def check_topk_in_stats(n_cases: int) -> None:
    """PEAGLE_VERIFY_TOPK_IN_STATS: on random bf16 rows with ties (quantised logits, tied runs,
    -inf / NaN entries), the candidate path must pick the full path's kept set and mass exactly
    (asserted row by row in Emu.row_filter), and the outputs must equal the default path's."""
    from test_verify_chain import make_case

    rng = np.random.default_rng(5)
    gen = torch.Generator().manual_seed(5)
    paths: dict[str, int] = {}
    checked = 0
    for case_i in range(n_cases):
        b = int(rng.integers(2, 7))
        v = int(rng.choice([300, 4097, 20011, 65536 + 37]))
        counts = [int(c) for c in rng.integers(0, 5, b)]
        top_k = [int(k) for k in rng.choice([1, 2, 50, 64, 65, 300, v + 1], b)]
        top_p = [float(p) for p in rng.choice([0.5, 0.9, 1.0], b)]
        temps = [float(t) if rng.random() < 0.85 else 0.0 for t in rng.uniform(0.3, 1.5, b)]
        scale = float(rng.choice([0.05, 1.0, 3.0, 8.0]))
        case = make_case(
            counts, v, gen, temps=temps, dtype=torch.bfloat16, scale=scale, top_k=top_k,
            top_p=top_p,
        )  # fmt: skip
        lg = case["target_logits"]
        if case_i % 3 == 0:  # coarse quantisation: many ties everywhere
            lg.copy_((lg * 2).round() / 2)
        if case_i % 4 == 1:  # tied runs at the top, -inf and NaN entries
            lg[:, 3::11] = lg.max()
            lg[:, ::7] = -math.inf
            lg[:, 5::97] = float("nan")
        if case_i % 5 == 2:  # clustered maxima: a block of equal top values in one thread
            lg[:, 64:128] = lg.max() + 1
        small = case_i % 2 == 1
        kw = dict(
            misalign=int(rng.integers(0, 8)), min_stats_elems=64 if small else MIN_STATS_ELEMS
        )
        emu = Emu(case, max(counts), topk_in_stats=True, **kw)
        out, acc = emu.run()
        ref_out, ref_acc = Emu(case, max(counts), **kw).run()
        assert np.array_equal(out, ref_out) and np.array_equal(acc, ref_acc), case_i
        checked += emu.stats_threshold_checks
        for pth in emu.filter_paths:
            paths[pth] = paths.get(pth, 0) + 1
        print(f"case {case_i:3d}: B={b} V={v} splits={emu.nsplit} top_k={top_k} top_p={top_p} "
              f"stats-path rows={emu.stats_threshold_checks}")  # fmt: skip
    print(f"ok: {n_cases} cases, {checked} rows thresholded from row_stats' candidates "
          f"(same kept set and mass as the full path), filter paths {paths}")  # fmt: skip


def main() -> None:
    from test_verify_chain import make_case, reference, run_op

    args = sys.argv[1:]
    if args and args[0] == "--topk-in-stats":
        check_topk_in_stats(int(args[1]) if len(args) > 1 else 24)
        return
    tiled = bool(args) and args[0] == "--tiled"  # PEAGLE_VERIFY_CHUNKS=0
    if tiled:
        args = args[1:]

    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(1)
    n_cases = int(args[0]) if args else 40
    total_rows = mismatches = twin_diffs = exact_rows = 0
    paths: dict[str, int] = {}
    sampling = {"chunk samples": 0, "excluded chunks subtracted": 0, "summed": 0,
                "summed and picked": 0, "checked draws": 0,
                "rounding neighbours": 0}  # fmt: skip
    chunk_rel = 0.0
    for case_i in range(n_cases):
        b = int(rng.integers(1, 9))
        v = int(rng.choice([5, 37, 111, 1000, 4097, 6001]))
        counts = [int(c) for c in rng.integers(0, 6, b)]
        temps = [float(t) if rng.random() < 0.8 else 0.0 for t in rng.uniform(0.3, 1.8, b)]
        kw = {}
        # 1, 3, 5: top_k; 2, 3, 5: top_p; 4, 5: draft_probs; 0, 6, 7: none (chunk sampling
        # unless exponentials); 6: peaked rows and drafts that mostly follow the argmax, so
        # rejected drafts often hold most of their chunk's mass.
        variant = case_i % 8
        if variant in (1, 3, 5):
            kw["top_k"] = [int(k) for k in rng.choice([0, 1, 3, 20, 300, v + 2], b)]
        if variant in (2, 3, 5):
            kw["top_p"] = [float(p) for p in rng.choice([1.0, 0.3, 0.9, 0.99], b)]
        if variant in (4, 5):
            kw["draft_probs"] = v > 1
        dtype = [torch.float32, torch.bfloat16, torch.float16][case_i % 3]
        scale = float(rng.choice([0.05, 1.0, 3.0, 8.0]))
        if variant == 6:
            scale = float(rng.choice([3.0, 4.0, 8.0]))
            kw["p_follow"] = 0.95
        case = make_case(counts, v, gen, temps=temps, dtype=dtype, scale=scale, **kw)
        if case_i % 7 == 3:  # ties and -inf
            lg = case["target_logits"]
            lg[:, ::5] = -math.inf
            lg[:, 1::7] = lg[:, 2::7].max()
        if variant == 6 and case_i % 24 in (14, 22) and sum(counts):
            # Every first draft rejected (u = 1), its row -inf outside a few tokens around the
            # draft, which holds most of the mass (score gap 1.5): the excluded chunk is summed
            # without the draft and often drawn from.
            lg = case["target_logits"]
            drafts = case["draft_token_ids"]
            for r in range(b):
                if counts[r]:
                    d0 = sum(counts[:r])
                    row, x, lo = d0 + r, int(drafts[d0]), max(0, int(drafts[d0]) - 3)
                    keep = lg[row, lo : x + 4].clone()
                    lg[row] = -math.inf
                    lg[row, lo : x + 4] = keep
                    keep[x - lo] = -math.inf
                    lg[row, x] = keep.float().max() + 1.5 * temps[r]  # over the others
            case["uniforms"] = torch.ones(len(drafts), dtype=torch.float64)
        if case_i % 5 == 2 and variant not in (0, 6):
            case["exponentials"] = torch.empty(b, v).exponential_(generator=gen)
        if case_i % 4 == 1:
            case["bonus_token_ids"] = torch.randint(0, v, (b,), generator=gen, dtype=torch.int32)
        if case_i % 9 == 4:
            case["request_mask"] = torch.tensor([bool(x) for x in rng.integers(0, 2, b)])
        max_n = max(counts)
        # many splits (and chunks): stresses bounds, seeds, merges and the chunk search
        small = case_i % 2 == 1 or variant == 6
        ekw = dict(
            misalign=int(rng.integers(0, 8)),
            min_stats_elems=64 if small else MIN_STATS_ELEMS,
            tile_threads=16 if small else THREADS,
        )
        emu = Emu(case, max_n, chunks=not tiled, **ekw)
        out, acc = emu.run()
        fp = None
        if case["top_k"] is None and case["top_p"] is None:  # the fused path applies
            fp = check_fused_schedule(emu, rng, grid=int(rng.choice([1, 3, 17, 528])))
        cpu = run_op(case, "cpu")
        ref = reference(case)
        differ = ~(
            (torch.from_numpy(out) == cpu.output_token_ids).all(dim=1)
            & (torch.from_numpy(acc) == cpu.num_accepted)
        )
        for r in torch.nonzero(differ).flatten().tolist():
            assert float(ref.margin[r]) < 1e-4, (
                f"case {case_i} request {r}: emulated {out[r].tolist()} vs CPU "
                f"{cpu.output_token_ids[r].tolist()} (margin {float(ref.margin[r]):.3g})"
            )
        twin = ""
        if emu.chunks:  # the tiled path on the same case: the same decisions, draws within rounding
            out_t, acc_t = Emu(case, max_n, chunks=False, **ekw).run()
            assert np.array_equal(acc, acc_t), (case_i, acc, acc_t)
            rows_t = np.nonzero(~(out == out_t).all(axis=1))[0].tolist()
            for r in rows_t:
                assert float(ref.margin[r]) < 1e-4, (
                    f"case {case_i} request {r}: chunk sampling {out[r].tolist()} vs tiled "
                    f"{out_t[r].tolist()} (margin {float(ref.margin[r]):.3g})"
                )
            twin_diffs += len(rows_t)
            twin = f" chunk/tiled diffs={len(rows_t)}"
        mismatches += int(differ.sum())
        total_rows += b
        for pth in emu.filter_paths:
            paths[pth] = paths.get(pth, 0) + 1
        sampling["chunk samples"] += emu.chunk_samples
        sampling["excluded chunks subtracted"] += emu.chunk_excluded
        sampling["summed"] += emu.chunk_summed
        sampling["summed and picked"] += emu.chunk_picked_excluded
        sampling["checked draws"] += emu.skip_checks
        sampling["rounding neighbours"] += emu.cdf_neighbours
        chunk_rel = max(chunk_rel, emu.chunk_max_rel)
        exact_rows += emu.exact_bound_rows
        print(
            f"case {case_i:3d}: B={b} V={v} {str(dtype)[6:]:9s} scale={scale:<5} kw={sorted(kw)} "
            f"splits={emu.nsplit}/{emu.nsample} {'chunks' if emu.chunks else 'tiled'} "
            f"near-tie diffs={int(differ.sum())}{twin}"
            + (f" fused lag={fp['lag']} items={fp['total']} grid={fp['grid']}" if fp else "")
        )
    mode = "tiled path everywhere" if tiled else "chunk sampling where it applies"
    print(f"{mode}: {sampling}, chunk mass error <= {chunk_rel:.2g} of the row's mass")
    print(f"ok: {n_cases} cases, {total_rows} requests, {mismatches} near-tie differences, "
          f"{twin_diffs} chunk/tiled differences, filter paths {paths}, "
          f"{exact_rows} row splits with the exact top-k bound")  # fmt: skip


if __name__ == "__main__":
    main()
