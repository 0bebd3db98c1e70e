// verify_chain kernel 1, row_stats (torch-free; included by verify_chain.cu only): every logits
// row is read once, split over `nsplit` CTAs. Per split: the first-index argmax (greedy rows: of
// the logits; random rows: of the scores s = logit * inv_t) and, for random rows, the online
// normaliser sum 2^(s log2 e - m log2 e) (one FFMA + one MUFU.EX2 per element, fp32 running sum,
// rescaled when the running max grows). Top-k rows also get a candidate bound for row_filter: the
// smallest over warps of each warp's ceil(k / 8)-th largest thread maximum (warp_kth_largest; a
// lower bound on the row's k-th largest score), or where streamed rows have large splits the
// exact k-th largest thread maximum (block_kth_largest; ws.exact_bound). Filtered rows also
// write a record (group_record) per group of kGroupVecs vectors of a thread (group_max). With
// chunk sampling, random rows also write every warp's (max, sum) over its chunk (chunk_mz). The
// kernel also zeroes the counters the later kernels use.
//
// With PEAGLE_VERIFY_TOPK_IN_STATS=1 (row_stats_kernel<D, true>), rows with top_k <= kStatsTopK
// also collect candidates in the same pass: every thread keeps its kThreadTop largest scores
// (branchless insertion), so every element of the split with key > the largest thread's
// kThreadTop-th key is in the lists. The split keeps the list entries above that key U, selects
// the top_k-th largest b among them (radix, 8-bit digits) and writes the entries >= max(b, U):
// every element of the split at or above its bound, top_k of them when b exists (stats_cands).
#pragma once
#include "verify_chain_common.cuh"

namespace peagle {
namespace {

// The rank-th largest (rank in [1, kThreads]) of kThreads floats in shared memory (one per
// thread, no NaN, -inf allowed): the smallest value with fewer than `rank` values strictly above
// it, by counting (kThreads compares per thread, all lanes reading the same words) instead of a
// sort. Whole CTA; `red`: kWarps floats of scratch. Ends with a barrier.
__device__ __forceinline__ float block_kth_largest(const float* v, int rank, float* red) {
  __syncthreads();  // every thread's value is in v
  const float mine = v[threadIdx.x];
  int above = 0;
  const float4* v4 = reinterpret_cast<const float4*>(v);
#pragma unroll 8
  for (int j = 0; j < kThreads / 4; ++j) {
    const float4 q = v4[j];
    above += (q.x > mine) + (q.y > mine) + (q.z > mine) + (q.w > mine);
  }
  float lo = above < rank ? mine : INFINITY;
#pragma unroll
  for (int d = kWarp / 2; d > 0; d >>= 1) lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, d));
  if (threadIdx.x % kWarp == 0) red[threadIdx.x / kWarp] = lo;
  __syncthreads();
  float r = red[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) r = fminf(r, red[w]);
  __syncthreads();
  return r;
}

// The rank-th largest (rank in [1, kWarp]) of the warp's lane values (no NaN, -inf allowed): the
// smallest value with fewer than `rank` lane values strictly above it (32 shuffles per lane).
// Every lane gets it.
__device__ __forceinline__ float warp_kth_largest(float v, int rank) {
  int above = 0;
#pragma unroll
  for (int j = 0; j < kWarp; ++j) above += __shfl_sync(0xffffffffu, v, j) > v;
  float lo = above < rank ? v : INFINITY;
#pragma unroll
  for (int d = kWarp / 2; d > 0; d >>= 1) lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, d));
  return lo;
}

__device__ __forceinline__ void zero_counters(const VerifyChainParams& p, const Workspace& ws) {
  const int64_t cta = blockIdx.x + static_cast<int64_t>(gridDim.x) * blockIdx.y;
  const int64_t step = static_cast<int64_t>(gridDim.x) * gridDim.y * kThreads;
  for (int64_t i = cta * kThreads + threadIdx.x; i < p.num_reqs; i += step) {
    ws.sample_arrivals[i] = 0;
  }
  if (ws.cand_count != nullptr) {
    for (int64_t i = cta * kThreads + threadIdx.x; i < p.num_rows; i += step) {
      ws.cand_count[i] = 0;
      ws.filter_arrivals[i] = 0;
    }
  }
}

struct StatsSmem {
  RowInfo info;
  Mzi warp[kWarps];
  float bound[kWarps];  // top-k rows: each warp's ceil(k / kWarps)-th largest thread maximum
  alignas(16) float maxima[kThreads];  // streamed top-k rows: the thread maxima (exact bound)
  float red[kWarps];
};

// One split of one logits row (the unit of work of row_stats and of the fused kernel's stats
// items): writes parts[row * nsplit + split] unless the row is skipped. Whole CTA; ends with a
// barrier, so `sm` may be reused right after.
// Shared memory of the candidate collection (row_stats_kernel<D, true> only).
struct CandSmem {
  uint32_t keys[kThreads * kThreadTop];
  uint32_t cnt[256];
  uint32_t n;      // entries appended
  uint32_t w;      // entries written
  uint32_t ub;     // max over threads of the inclusive completeness bound
  uint32_t above;  // radix: entries in higher digits
  int32_t digit;
};

// Warp 0: the digit of a 256-bin histogram (scanned from the top) holding the rank-th largest
// entry (rank >= 1) and, via *above, the entries in higher digits; -1 if none.
__device__ __forceinline__ void find_digit256(const uint32_t* cnt, uint32_t rank, int* digit,
                                              uint32_t* above) {
  const int lane = threadIdx.x % kWarp;
  constexpr int kPer = 256 / kWarp;
  const int lo = lane * kPer;
  uint32_t mine = 0;
#pragma unroll
  for (int b = 0; b < kPer; ++b) mine += cnt[lo + b];
  uint32_t higher = 0;
  for (int l = 0; l < kWarp; ++l) {
    const uint32_t x = __shfl_sync(0xffffffffu, mine, l);
    if (l > lane) higher += x;
  }
  int found = -1;
  uint32_t found_above = 0, cum = higher;
  for (int b = lo + kPer - 1; b >= lo; --b) {
    const uint32_t c = cnt[b];
    if (found < 0 && cum < rank && rank <= cum + c) {
      found = b;
      found_above = cum;
    }
    cum += c;
  }
  const unsigned won = __ballot_sync(0xffffffffu, found >= 0);
  const int src = won ? __ffs(static_cast<int>(won)) - 1 : 0;
  *digit = won ? __shfl_sync(0xffffffffu, found, src) : -1;
  *above = __shfl_sync(0xffffffffu, found_above, src);
}

// Inserts q (no NaN) into the descending list l[0..kThreadTop) (the list keeps the multiset of
// the kThreadTop largest values seen).
__device__ __forceinline__ void top_insert(float (&l)[kThreadTop], float q) {
#pragma unroll
  for (int j = 0; j < kThreadTop - 1; ++j) {
    const float h = fmaxf(l[j], q);
    q = fminf(l[j], q);
    l[j] = h;
  }
  l[kThreadTop - 1] = fmaxf(l[kThreadTop - 1], q);
}

// End of a split with candidates: from every thread's list (seen: elements the thread saw),
// writes the split's candidates and TopkMeta. Whole CTA.
__device__ __forceinline__ void stats_cands(const Workspace& ws, int64_t row, int split,
                                            int32_t top_k, const float (&l)[kThreadTop],
                                            int32_t seen, CandSmem& cs) {
  if (threadIdx.x == 0) {
    cs.n = 0;
    cs.w = 0;
    cs.ub = 0;
  }
  __syncthreads();
  // Elements this thread dropped have key <= key(l[last]): complete at keys >= that + 1.
  const uint32_t ub = seen > kThreadTop ? score_key(l[kThreadTop - 1]) + 1u : 0u;
  if (ub) atomicMax(&cs.ub, ub);
  __syncthreads();
  const uint32_t u = cs.ub;
  const int nv = seen < kThreadTop ? seen : kThreadTop;
  uint32_t mine[kThreadTop];
  int c = 0;
#pragma unroll
  for (int j = 0; j < kThreadTop; ++j) {
    mine[j] = score_key(l[j]);
    c += j < nv && mine[j] >= u;
  }
  if (c > 0) {
    uint32_t pos = atomicAdd(&cs.n, static_cast<uint32_t>(c));
#pragma unroll
    for (int j = 0; j < kThreadTop; ++j) {
      if (j < nv && mine[j] >= u) cs.keys[pos++] = mine[j];
    }
  }
  __syncthreads();
  const uint32_t e = cs.n;
  uint32_t bound = u;
  if (e >= static_cast<uint32_t>(top_k)) {
    // Radix select (4 levels of 8 bits) of the top_k-th largest entry: a key prefix b with
    // exactly the entries >= the top_k-th largest at or above it.
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
    uint32_t prefix = 0, pmask = 0, left = static_cast<uint32_t>(top_k);
#pragma unroll 1
    for (int level = 0; level < 4; ++level) {
      const int shift = 24 - 8 * level;
      cs.cnt[threadIdx.x] = 0;  // kThreads == 256 bins
      __syncthreads();
      for (uint32_t i = threadIdx.x; i < e; i += kThreads) {
        const uint32_t k = cs.keys[i];
        if ((k & pmask) == prefix) atomicAdd(&cs.cnt[(k >> shift) & 255u], 1u);
      }
      __syncthreads();
      if (warp == 0) {
        int d;
        uint32_t above;
        find_digit256(cs.cnt, left, &d, &above);
        if (lane == 0) {
          cs.digit = d < 0 ? 0 : d;  // cannot happen: 1 <= left <= entries
          cs.above = above;
        }
      }
      __syncthreads();
      const uint32_t d = static_cast<uint32_t>(cs.digit);
      left -= cs.above;
      prefix |= d << shift;
      pmask |= 255u << shift;
      const bool whole_bucket = cs.cnt[d] == left;
      __syncthreads();
      if (whole_bucket) break;
    }
    if (prefix > bound) bound = prefix;
  }
  // Write the entries >= bound (all of them: more than kStatsCandCap -> unusable).
  uint32_t* dst = ws.topk_cand + (row * ws.nsplit + split) * kStatsCandCap;
  for (uint32_t i = threadIdx.x; i < e; i += kThreads) {
    const uint32_t k = cs.keys[i];
    if (k >= bound) {
      const uint32_t pos = atomicAdd(&cs.w, 1u);
      if (pos < kStatsCandCap) dst[pos] = k;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    TopkMeta meta;
    meta.n = cs.w <= static_cast<uint32_t>(kStatsCandCap) ? cs.w : kStatsOverflow;
    meta.bound = bound;
    ws.topk_meta[row * ws.nsplit + split] = meta;
  }
}

template <LogitsDtype D, bool kCands = false>
__device__ __forceinline__ void stats_item(const VerifyChainParams& p, const Workspace& ws,
                                           int64_t row, int split, StatsSmem& sm,
                                           CandSmem* cs = nullptr) {
  const int nsplit = ws.nsplit;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (warp == 0) {
    const RowInfo info = row_info(p, row);
    if (lane == 0) sm.info = info;
  }
  __syncthreads();
  const RowInfo info = sm.info;
  if (info.mode != kRowSkip) {
    const char* rp = row_ptr(p, row, Elem<D>::kSize);
    Mzi a;
    if (info.mode == kRowGreedy) {
      float bval = -INFINITY;  // NaN never compares greater, -inf never recorded
      int32_t bidx = -1;
      stream_split<D>(rp, p.vocab_size, split, nsplit, [&](int32_t v0, const float* x, auto cnt) {
        constexpr int kN = decltype(cnt)::value;
        int vk = -1;  // position of a new maximum in this vector (no per-element index add)
#pragma unroll
        for (int k = 0; k < kN; ++k) {
          if (x[k] > bval) {
            bval = x[k];
            vk = k;
          }
        }
        if (vk >= 0) bidx = v0 + vk;
      });
      a = Mzi{bval, 0.0f, bidx};
    } else if (kCands && stats_cands_row(ws, info, p.vocab_size)) {
      // As the random branch below, plus every thread's kThreadTop largest scores.
      const float inv_t = info.inv_t;
      float bval = -INFINITY, z = 0.0f, ml = -INFINITY;
      int32_t bidx = -1, seen = 0;
      float lst[kThreadTop];
#pragma unroll
      for (int j = 0; j < kThreadTop; ++j) lst[j] = -INFINITY;
      stream_split<D>(rp, p.vocab_size, split, nsplit, [&](int32_t v0, const float* x, auto cnt) {
        constexpr int kN = decltype(cnt)::value;
        float s[kN];
        float vm = bval;
        int vk = -1;
#pragma unroll
        for (int k = 0; k < kN; ++k) {
          s[k] = x[k] * inv_t;
          if (s[k] > vm) {
            vm = s[k];
            vk = k;
          }
        }
        if (vk >= 0) {
          z *= ex2_approx((bval - vm) * kLog2e);
          bval = vm;
          bidx = v0 + vk;
          ml = vm * kLog2e;
        }
#pragma unroll
        for (int k = 0; k < kN; ++k) {
          z += fast_weight(s[k], ml);
          top_insert(lst, fmaxf(s[k], -INFINITY));  // fmaxf(NaN, -inf) = -inf: sanitized
        }
        seen += kN;
      });
      a = Mzi{bval, z, bidx};
      stats_cands(ws, row, split, info.top_k, lst, seen, *cs);
    } else {
      const float inv_t = info.inv_t;
      float bval = -INFINITY, z = 0.0f, ml = -INFINITY;
      int32_t bidx = -1;
      // kGroups (filtered rows with group_max): also every group's record (group_record): its
      // largest vector maximum g1 and which vector holds it, and the largest of the others, g2.
      auto pass = [&](auto groups) {
        constexpr bool kGroups = decltype(groups)::value;
        float g1 = -INFINITY, g2 = -INFINITY;
        int gv = 0, gi = 0;
        uint2* gp = kGroups ? group_max_of_chunk(ws, row, split, warp) + lane : nullptr;
        stream_split<D>(rp, p.vocab_size, split, nsplit, [&](int32_t v0, const float* x, auto cnt) {
          constexpr int kN = decltype(cnt)::value;
          float s[kN];
          float vm = bval;
          int vk = -1;  // position of a new maximum in this vector
#pragma unroll
          for (int k = 0; k < kN; ++k) {
            s[k] = x[k] * inv_t;
            if (s[k] > vm) {
              vm = s[k];
              vk = k;
            }
          }
          if (vk >= 0) {  // rare after the first vectors: rescale the running sum
            z *= ex2_approx((bval - vm) * kLog2e);
            bval = vm;
            bidx = v0 + vk;
            ml = vm * kLog2e;
          }
#pragma unroll
          for (int k = 0; k < kN; ++k) z += fast_weight(s[k], ml);
          if constexpr (kGroups && kN == Elem<D>::kPerVec) {  // body vectors only
            float vmax = -INFINITY;
#pragma unroll
            for (int k = 0; k < kN; ++k) vmax = fmaxf(vmax, s[k]);  // NaN ignored
            if (vmax > g1) {
              g2 = g1;
              g1 = vmax;
              gi = gv;
            } else {
              g2 = fmaxf(g2, vmax);
            }
            if (++gv == kGroupVecs) {
              *gp = group_record(g1, gi, g2);
              gp += kWarp;
              g1 = g2 = -INFINITY;
              gv = gi = 0;
            }
          }
        });
        if constexpr (kGroups) {
          if (gv > 0) *gp = group_record(g1, gi, g2);
        }
      };
      if (ws.group_max != nullptr && info.mode == kRowFiltered) {
        pass(std::true_type{});
      } else {
        pass(std::false_type{});
      }
      a = Mzi{bval, z, bidx};
    }
    const float thread_max = a.m;
    if (info.mode == kRowGreedy) {
      const ArgMax g = warp_argmax(ArgMax{a.m, a.idx});
      a = Mzi{g.val, 0.0f, g.idx};
    } else {
      a = warp_mzi(a);
      if (lane == 0 && ws.chunk_mz != nullptr) {  // this warp's chunk, for chunk sampling
        ws.chunk_mz[(row * nsplit + split) * kWarps + warp] =
            make_float2(a.idx < 0 ? -INFINITY : a.m, a.z);
      }
    }
    if (lane == 0) sm.warp[warp] = a;
    // Top-k rows: candidate bound = the smallest over warps of each warp's r-th largest thread
    // maximum, r = ceil(k / kWarps): kWarps * r >= k thread maxima (distinct elements of the
    // split) are >= it, so it is a lower bound on the split's (and the row's) k-th largest score;
    // a little looser than the k-th largest of all kThreads maxima, at 32 compares per thread
    // instead of kThreads.
    const bool want_bound = info.mode == kRowFiltered && top_k_active(info.top_k, p.vocab_size) &&
                            info.top_k <= kThreads;
    // Where row_filter streams the rows with large splits (ws.exact_bound:
    // verify_chain_heuristics::use_exact_bound) the bound is the exact k-th largest of all
    // thread maxima: there the looser one let more candidates into the cross-CTA collection.
    const bool exact = want_bound && ws.exact_bound;
    if (exact) {
      sm.maxima[threadIdx.x] = thread_max;
      const float b = block_kth_largest(sm.maxima, info.top_k, sm.red);
      if (threadIdx.x == 0) sm.bound[0] = b;
      for (int w = 1; w < kWarps && threadIdx.x == 0; ++w) sm.bound[w] = b;
    } else if (want_bound) {
      const float b = warp_kth_largest(thread_max, (info.top_k + kWarps - 1) / kWarps);
      if (lane == 0) sm.bound[warp] = b;  // thread_max: -inf if the thread saw no finite score
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      Mzi t = sm.warp[0];
      for (int w = 1; w < kWarps; ++w) t = merge_mzi(t, sm.warp[w]);
      RowPartial out;
      out.m = t.idx < 0 ? -INFINITY : t.m;
      out.z = t.z;
      out.idx = t.idx;
      float bound = -INFINITY;
      if (want_bound) {
        bound = sm.bound[0];
        for (int w = 1; w < kWarps; ++w) bound = fminf(bound, sm.bound[w]);
      }
      out.bound = bound;
      ws.parts[row * nsplit + split] = out;
    }
  }
  __syncthreads();
}

template <LogitsDtype D, bool kCands = false>
__global__ void __launch_bounds__(kThreads, 4)
    row_stats_kernel(const VerifyChainParams p, const Workspace ws) {
  pdl_launch_dependents();
  __shared__ StatsSmem sm;
  __shared__ std::conditional_t<kCands, CandSmem, char> cs;
  zero_counters(p, ws);
  for (int64_t row = blockIdx.y; row < p.num_rows; row += gridDim.y) {
    if constexpr (kCands) {
      stats_item<D, true>(p, ws, row, static_cast<int>(blockIdx.x), sm, &cs);
    } else {
      stats_item<D>(p, ws, row, static_cast<int>(blockIdx.x), sm);
    }
  }
}

}  // namespace
}  // namespace peagle
