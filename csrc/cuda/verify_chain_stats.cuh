// verify_chain kernel 1, row_stats (torch-free; included by verify_chain.cu only): every logits
// row is read once, split over `nsplit` CTAs. Per split: the first-index argmax (greedy rows: of
// the logits; random rows: of the scores s = logit * inv_t) and, for random rows, the online
// normaliser sum 2^(s log2 e - m log2 e) (one FFMA + one MUFU.EX2 per element, fp32 running sum,
// rescaled when the running max grows). Top-k rows also get a candidate bound for row_filter: the
// k-th largest of the 256 per-thread maxima of the split (a lower bound on the row's k-th largest
// score). The kernel also zeroes the counters the later kernels use.
#pragma once
#include "verify_chain_common.cuh"

namespace peagle {
namespace {

// Descending bitonic sort of kThreads floats in shared memory (whole CTA, one element per
// thread; -inf allowed, no NaN).
__device__ __forceinline__ void block_sort_desc(float* s) {
  const int i = threadIdx.x;
#pragma unroll 1
  for (int size = 2; size <= kThreads; size <<= 1) {
#pragma unroll 1
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      const int j = i ^ stride;
      if (j > i) {
        const bool desc = (i & size) == 0;
        const float a = s[i], b = s[j];
        if (desc ? a < b : a > b) {
          s[i] = b;
          s[j] = a;
        }
      }
      __syncthreads();
    }
  }
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
  float sort[kThreads];
};

// One split of one logits row (the unit of work of row_stats and of the fused kernel's stats
// items): writes parts[row * nsplit + split] unless the row is skipped. Whole CTA; ends with a
// barrier, so `sm` may be reused right after.
template <LogitsDtype D>
__device__ __forceinline__ void stats_item(const VerifyChainParams& p, const Workspace& ws,
                                           int64_t row, int split, StatsSmem& sm) {
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
    } else {
      const float inv_t = info.inv_t;
      float bval = -INFINITY, z = 0.0f, ml = -INFINITY;
      int32_t bidx = -1;
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
      });
      a = Mzi{bval, z, bidx};
    }
    const float thread_max = a.m;
    if (info.mode == kRowGreedy) {
      const ArgMax g = warp_argmax(ArgMax{a.m, a.idx});
      a = Mzi{g.val, 0.0f, g.idx};
    } else {
      a = warp_mzi(a);
    }
    if (lane == 0) sm.warp[warp] = a;
    // Top-k rows: candidate bound = k-th largest per-thread maximum of this split.
    const bool want_bound = info.mode == kRowFiltered && top_k_active(info.top_k, p.vocab_size) &&
                            info.top_k <= kThreads;
    if (want_bound) {
      sm.sort[threadIdx.x] = thread_max;  // -inf if the thread saw no finite score
      __syncthreads();
      block_sort_desc(sm.sort);
    } else {
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      Mzi t = sm.warp[0];
      for (int w = 1; w < kWarps; ++w) t = merge_mzi(t, sm.warp[w]);
      RowPartial out;
      out.m = t.idx < 0 ? -INFINITY : t.m;
      out.z = t.z;
      out.idx = t.idx;
      out.bound = want_bound ? sm.sort[info.top_k - 1] : -INFINITY;
      ws.parts[row * nsplit + split] = out;
    }
  }
  __syncthreads();
}

template <LogitsDtype D>
__global__ void __launch_bounds__(kThreads, 4)
    row_stats_kernel(const VerifyChainParams p, const Workspace ws) {
  pdl_launch_dependents();
  __shared__ StatsSmem sm;
  zero_counters(p, ws);
  for (int64_t row = blockIdx.y; row < p.num_rows; row += gridDim.y) {
    stats_item<D>(p, ws, row, static_cast<int>(blockIdx.x), sm);
  }
}

}  // namespace
}  // namespace peagle
