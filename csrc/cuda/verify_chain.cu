// CUDA verify_chain (torch-free): chain verification straight from the target logits.
// Semantics: peagle/kernels/verify_chain.h (shared with the CPU op). Pipeline, all on one stream,
// no host synchronisation, graph-capturable (scratch is fully rewritten before it is read):
//
//   1. row_stats   grid (S, R): every logits row is read once, split over S CTAs when the batch is
//                  small. Per split: first-index argmax of the scores and, for random requests,
//                  the online softmax normaliser (max, sum exp) -> RowPartial[R, S].
//   2. row_filter  (only when top_k/top_p tensors are given) one 1024-thread CTA per row of a
//                  filtered random request: radix select on the order-preserving key of the
//                  float32 score (11/11/10-bit digits; counts for top-k, 2^-32 fixed-point
//                  masses for top-p, so the result is deterministic) -> kept-set threshold key
//                  and the kept mass Z -> RowStats[R].
//   3. decide      one CTA per request, one warp per row: merges each row's partials in a fixed
//                  order (or reads its RowStats), evaluates the acceptance chain (greedy: argmax
//                  equality; random: u <= p(x)/q(x) with fp64) and writes the accepted prefix, -1
//                  padding and the counters. Greedy requests are finished here; random ones leave a
//                  Decision for the sampling row.
//   4. sample      grid (S2, B): Gumbel-max over the one row per request that needs a token
//                  (recovered or bonus), Philox noise generated in place; candidates that cannot
//                  win (score + max Gumbel < a known lower bound) skip the noise.
//   5. finalize    one warp per request: merges the S2 partial argmaxes and writes the token.
// All reductions run in a fixed order, so results are bit-identical run to run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "peagle/kernels/verify_chain.h"

namespace peagle {
namespace {

constexpr int kWarp = 32;
constexpr int kStatsThreads = 256;
constexpr int kFilterThreads = 1024;
constexpr int kSampleThreads = 256;
constexpr int kWarpsPerReqBlock = 8;  // finalize: one warp per request
constexpr int kDecideThreads = 256;   // decide: one CTA per request, evaluating
constexpr int kDecideWarps = kDecideThreads / 32;
constexpr int kDecideChunk = 32;          // up to 32 rows at a time
constexpr int kMinElemsPerSplit = 4096;   // row_stats: at least this many logits per CTA
constexpr int kMinGroupsPerSplit = 1024;  // sample: at least this many 4-token groups per CTA
constexpr int kMaxGridY = 65535;
constexpr int kHistBins = 2048;              // 11-bit radix digits
constexpr float kGumbelMax = 16.75f;         // > the largest Gumbel draw (16.636)
constexpr float kGumbelMin = 2.82f;          // > minus the smallest Gumbel draw (-2.812)
constexpr double kMassScale = 4294967296.0;  // 2^32 fixed point for top-p masses (e <= 1)

enum : int32_t { kModeDone = 0, kModeRecovered = 1, kModeBonus = 2 };

struct RowPartial {  // one split of one row
  float m;           // max score (-inf if none finite)
  float z;           // sum of expf(s - m) (random requests only)
  int32_t idx;       // first index of the max (-1 if none)
  int32_t pad;
};

struct RowStats {  // filtered rows (written by row_filter)
  float m;
  uint32_t key;  // kept iff score_key(s) >= key
  double z;      // kept mass
  int32_t first_max;
  int32_t pad[3];
};

struct Decision {  // what finalize / sample need per request
  int32_t mode;
  int32_t accepted;
  int32_t exclude;    // draft id excluded from the recovered token (no draft_probs), else -1
  int32_t first_max;  // fallback when no candidate exists
  int64_t row;        // logits row to sample
  int64_t q_row;      // draft_probs row for the residual, -1 without
  float m;
  float inv_t;
  float zf;
  uint32_t key;
};

struct Layout {
  int splits = 1;
  int sample_splits = 1;
  size_t off_partials = 0, off_stats = 0, off_decisions = 0, off_samples = 0, total = 0;
};

__host__ __device__ inline size_t align_up(size_t x) {
  return (x + 255) & ~size_t(255);
}

int sm_count() {
  static int cached[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 132;
  if (dev < 0 || dev >= 64) return 132;
  if (cached[dev] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) {
      n = 132;
    }
    cached[dev] = n;
  }
  return cached[dev];
}

Layout plan(const VerifyChainParams& p) {
  Layout l;
  const int64_t rows = p.num_rows > 0 ? p.num_rows : 1;
  const int64_t reqs = p.num_reqs > 0 ? p.num_reqs : 1;
  const int64_t target = 4LL * sm_count();
  int64_t s = (target + rows - 1) / rows;
  const int64_t s_cap = (p.vocab_size + kMinElemsPerSplit - 1) / kMinElemsPerSplit;
  l.splits = static_cast<int>(s < 1 ? 1 : (s > s_cap ? (s_cap < 1 ? 1 : s_cap) : s));
  int64_t s2 = (2LL * sm_count() + reqs - 1) / reqs;
  const int64_t groups = (static_cast<int64_t>(p.vocab_size) + 3) / 4;
  const int64_t s2_cap = (groups + kMinGroupsPerSplit - 1) / kMinGroupsPerSplit;
  l.sample_splits = static_cast<int>(s2 < 1 ? 1 : (s2 > s2_cap ? (s2_cap < 1 ? 1 : s2_cap) : s2));
  size_t off = 0;
  l.off_partials = off;
  off = align_up(off + sizeof(RowPartial) * static_cast<size_t>(rows) * l.splits);
  l.off_stats = off;
  off = align_up(off + sizeof(RowStats) * static_cast<size_t>(rows));
  l.off_decisions = off;
  off = align_up(off + sizeof(Decision) * static_cast<size_t>(reqs));
  l.off_samples = off;
  off = align_up(off + sizeof(ArgMax) * static_cast<size_t>(reqs) * l.sample_splits);
  l.total = off;
  return l;
}

// ---- small device helpers --------------------------------------------------------------------

// 2^-32 fixed point of a weight e = expf(s - m) in [0, 1]; NaN (degenerate rows) -> 0.
__device__ __forceinline__ unsigned long long fixed_mass(float e) {
  return e > 0.0f ? __float2ull_rn(e * 4294967296.0f) : 0ull;
}

// Key of a score for the kept-set threshold: -0 and +0 compare equal as floats, so map -0 -> +0.
__device__ __forceinline__ uint32_t score_key(float s) {
  return ordered_key(s + 0.0f);
}

__device__ __forceinline__ bool request_is_real(const VerifyChainParams& p, int32_t r) {
  return p.request_mask == nullptr || p.request_mask[r];
}

__device__ __forceinline__ bool request_is_filtered(const VerifyChainParams& p, int32_t r) {
  const bool k = p.top_k != nullptr && top_k_active(p.top_k[r], p.vocab_size);
  const bool tp = p.top_p != nullptr && top_p_active(p.top_p[r]);
  return k || tp;
}

// The request owning logits row `row`: the largest r with request_span(r).first_row <= row.
__device__ int32_t request_of_row(const VerifyChainParams& p, int64_t row) {
  int32_t lo = 0, hi = p.num_reqs - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) >> 1;
    if (request_span(p.cu_num_draft_tokens, mid, p.num_draft_tokens).first_row <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

__device__ __forceinline__ ArgMax shfl_argmax(ArgMax a, int delta) {
  ArgMax b;
  b.val = __shfl_down_sync(0xffffffffu, a.val, delta);
  b.idx = __shfl_down_sync(0xffffffffu, a.idx, delta);
  return b;
}

__device__ __forceinline__ ArgMax warp_argmax(ArgMax a) {
#pragma unroll
  for (int d = kWarp / 2; d > 0; d >>= 1) a = argmax_merge(a, shfl_argmax(a, d));
  return a;
}

// (max, sum, argmax) of two partials; z is rescaled to the merged max.
struct Mzi {
  float m;
  float z;
  int32_t idx;
};

__device__ __forceinline__ Mzi merge_mzi(const Mzi& a, const Mzi& b) {
  const ArgMax am = argmax_merge(ArgMax{a.m, a.idx}, ArgMax{b.m, b.idx});
  Mzi out;
  out.idx = am.idx;
  out.m = am.idx < 0 ? -INFINITY : am.val;
  float z = 0.0f;
  if (a.idx >= 0) z += a.m == out.m ? a.z : a.z * expf(a.m - out.m);
  if (b.idx >= 0) z += b.m == out.m ? b.z : b.z * expf(b.m - out.m);
  out.z = z;
  return out;
}

__device__ __forceinline__ Mzi warp_mzi(Mzi a) {
#pragma unroll
  for (int d = kWarp / 2; d > 0; d >>= 1) {
    Mzi b;
    b.m = __shfl_down_sync(0xffffffffu, a.m, d);
    b.z = __shfl_down_sync(0xffffffffu, a.z, d);
    b.idx = __shfl_down_sync(0xffffffffu, a.idx, d);
    a = merge_mzi(a, b);
  }
  return a;
}

// ---- logits access -----------------------------------------------------------------------------

template <LogitsDtype D>
struct Elem {
  static constexpr int kSize = D == LogitsDtype::kFloat32 ? 4 : 2;
  static constexpr int kPerVec = 16 / kSize;
};

template <LogitsDtype D>
__device__ __forceinline__ float load_scalar(const char* row, int64_t v) {
  if constexpr (D == LogitsDtype::kFloat32) {
    return __ldg(reinterpret_cast<const float*>(row) + v);
  } else if constexpr (D == LogitsDtype::kBFloat16) {
    return bf16_bits_to_float(__ldg(reinterpret_cast<const unsigned short*>(row) + v));
  } else {
    return __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(row) + v)));
  }
}

template <LogitsDtype D>
__device__ __forceinline__ void unpack(const uint4& raw, float* out) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  if constexpr (D == LogitsDtype::kFloat32) {
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = __uint_as_float(w[i]);
  } else if constexpr (D == LogitsDtype::kBFloat16) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xffffu)));
      out[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
    }
  }
}

// Calls f(v0, vals, std::integral_constant<int, N>) for this CTA's share (split of nsplit) of a
// row: 16-byte vectors over the aligned body, scalars for the unaligned head (split 0) and tail
// (last split). Loads are issued four vectors at a time per thread.
template <LogitsDtype D, typename F>
__device__ __forceinline__ void visit_row(const char* row, int32_t vocab, int split, int nsplit,
                                          F&& f) {
  constexpr int kEs = Elem<D>::kSize, kEpv = Elem<D>::kPerVec;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(row);
  int32_t head = static_cast<int32_t>(((16 - (addr & 15)) & 15) / kEs);
  if (head > vocab) head = vocab;
  const int32_t nvec = (vocab - head) / kEpv;
  const int32_t body_end = head + nvec * kEpv;
  const int32_t vb = static_cast<int32_t>(static_cast<int64_t>(nvec) * split / nsplit);
  const int32_t ve = static_cast<int32_t>(static_cast<int64_t>(nvec) * (split + 1) / nsplit);
  const uint4* vec = reinterpret_cast<const uint4*>(row + static_cast<int64_t>(head) * kEs);
  const int32_t stride = blockDim.x;
  int32_t i = vb + threadIdx.x;
  for (; i + 3 * stride < ve; i += 4 * stride) {
    uint4 raw[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) raw[u] = __ldg(vec + i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      float vals[kEpv];
      unpack<D>(raw[u], vals);
      f(head + (i + u * stride) * kEpv, vals, std::integral_constant<int, kEpv>{});
    }
  }
  for (; i < ve; i += stride) {
    float vals[kEpv];
    unpack<D>(__ldg(vec + i), vals);
    f(head + i * kEpv, vals, std::integral_constant<int, kEpv>{});
  }
  if (split == 0) {
    for (int32_t v = threadIdx.x; v < head; v += stride) {
      float x[1] = {load_scalar<D>(row, v)};
      f(v, x, std::integral_constant<int, 1>{});
    }
  }
  if (split == nsplit - 1) {
    for (int32_t v = body_end + threadIdx.x; v < vocab; v += stride) {
      float x[1] = {load_scalar<D>(row, v)};
      f(v, x, std::integral_constant<int, 1>{});
    }
  }
}

__device__ __forceinline__ const char* row_ptr(const VerifyChainParams& p, int64_t row, int es) {
  return static_cast<const char*>(p.logits) + row * p.logits_row_stride * es;
}

// ---- 1. row statistics -------------------------------------------------------------------------

template <LogitsDtype D>
__global__ void __launch_bounds__(kStatsThreads)
    row_stats_kernel(const VerifyChainParams p, RowPartial* __restrict__ parts, int nsplit) {
  __shared__ int s_mode;  // 0 skip, 1 argmax only (greedy), 2 argmax + normaliser (random)
  __shared__ float s_inv_t;
  __shared__ Mzi s_warp[kStatsThreads / kWarp];
  const int split = blockIdx.x;
  for (int64_t row = blockIdx.y; row < p.num_rows; row += gridDim.y) {
    if (threadIdx.x == 0) {
      const int32_t r = request_of_row(p, row);
      const float t = p.temperature[r];
      s_mode = !request_is_real(p, r) ? 0 : (is_greedy_temperature(t) ? 1 : 2);
      s_inv_t = s_mode == 2 ? inverse_temperature(t) : 1.0f;
    }
    __syncthreads();
    const int mode = s_mode;
    const float inv_t = s_inv_t;
    if (mode != 0) {
      float bval = -INFINITY, z = 0.0f;
      int32_t bidx = -1;
      const bool need_sum = mode == 2;
      visit_row<D>(row_ptr(p, row, Elem<D>::kSize), p.vocab_size, split, nsplit,
                   [&](int32_t v0, const float* x, auto cnt) {
                     constexpr int kN = decltype(cnt)::value;
                     float s[kN];
                     float lm = -INFINITY;
                     int32_t li = -1;
#pragma unroll
                     for (int k = 0; k < kN; ++k) {
                       s[k] = need_sum ? score_of(x[k], inv_t) : sanitize_score(x[k]);
                       if (s[k] > lm) {
                         lm = s[k];
                         li = v0 + k;
                       }
                     }
                     if (li < 0) return;
                     if (lm > bval) {
                       if (need_sum && bidx >= 0) z *= expf(bval - lm);
                       bval = lm;
                       bidx = li;
                     } else if (lm == bval && li < bidx) {
                       bidx = li;
                     }
                     if (need_sum) {
#pragma unroll
                       for (int k = 0; k < kN; ++k) z += expf(s[k] - bval);
                     }
                   });
      Mzi a{bidx < 0 ? -INFINITY : bval, z, bidx};
      a = warp_mzi(a);
      const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
      if (lane == 0) s_warp[warp] = a;
      __syncthreads();
      if (threadIdx.x == 0) {
        Mzi t = s_warp[0];
        for (int w = 1; w < kStatsThreads / kWarp; ++w) t = merge_mzi(t, s_warp[w]);
        parts[row * nsplit + split] = RowPartial{t.m, t.z, t.idx, 0};
      }
    }
    __syncthreads();
  }
}

// ---- 2. top-k / top-p threshold ----------------------------------------------------------------

// Warp 0 finds a digit in a 2^bits-bin histogram scanned from the top. Count mode (top-k): the
// digit holding the `rank`-th largest element (rank >= 1). Mass mode (top-p): the lowest
// non-empty digit whose top element has (above + mass of higher digits) < target. Returns the
// digit and, via *above_out, the count/mass of the higher digits.
template <bool kMass>
__device__ void find_digit(const uint32_t* cnt, const unsigned long long* mass, int bins,
                           unsigned long long rank, double target, unsigned long long above,
                           int* digit_out, unsigned long long* above_out) {
  const int lane = threadIdx.x % kWarp;
  const int per = bins / kWarp;
  const int lo = lane * per;
  unsigned long long mine = 0;
  for (int b = lo; b < lo + per; ++b) mine += kMass ? mass[b] : cnt[b];
  // Count/mass of the higher lanes' bins (every lane takes part in every shuffle).
  unsigned long long higher = 0;
  for (int l = 0; l < kWarp; ++l) {
    const unsigned long long x = __shfl_sync(0xffffffffu, mine, l);
    if (l > lane) higher += x;
  }
  int found = -1;
  unsigned long long found_above = 0;
  unsigned long long cum = higher;
  for (int b = lo + per - 1; b >= lo; --b) {
    const unsigned long long c = kMass ? mass[b] : cnt[b];
    if (kMass) {
      if (cnt[b] > 0 && static_cast<double>(above + cum) < target) {
        found = b;  // keep descending: we want the lowest such digit
        found_above = cum;
      }
    } else if (found < 0 && cum < rank && rank <= cum + c) {
      found = b;
      found_above = cum;
    }
    cum += c;
  }
  // Count mode: exactly one lane finds the digit. Mass mode: the lowest digit found wins.
  int best = found < 0 ? 0x7fffffff : found;
  for (int d = kWarp / 2; d > 0; d >>= 1) best = min(best, __shfl_xor_sync(0xffffffffu, best, d));
  const unsigned won = __ballot_sync(0xffffffffu, found == best && found >= 0);
  const int src = won ? __ffs(static_cast<int>(won)) - 1 : 0;
  found_above = __shfl_sync(0xffffffffu, found_above, src);
  *digit_out = best == 0x7fffffff ? -1 : best;
  *above_out = found_above;
}

template <LogitsDtype D>
__global__ void __launch_bounds__(kFilterThreads)
    row_filter_kernel(const VerifyChainParams p, const RowPartial* __restrict__ parts, int nsplit,
                      RowStats* __restrict__ stats) {
  __shared__ uint32_t s_cnt[kHistBins];
  __shared__ unsigned long long s_mass[kHistBins];
  __shared__ int s_active, s_digit, s_first_max;
  __shared__ float s_inv_t, s_m, s_top_p;
  __shared__ int32_t s_top_k;
  __shared__ unsigned long long s_above, s_red[kFilterThreads / kWarp];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  for (int64_t row = blockIdx.x; row < p.num_rows; row += gridDim.x) {
    if (warp == 0) {
      const int32_t r = request_of_row(p, row);
      const bool active = request_is_real(p, r) && !is_greedy_temperature(p.temperature[r]) &&
                          request_is_filtered(p, r);
      Mzi a{-INFINITY, 0.0f, -1};
      if (active) {
        for (int s = lane; s < nsplit; s += kWarp) {
          const RowPartial q = parts[row * nsplit + s];
          a = merge_mzi(a, Mzi{q.m, q.z, q.idx});
        }
        a = warp_mzi(a);
      }
      if (lane == 0) {
        s_active = active;
        s_m = a.m;
        s_first_max = a.idx < 0 ? 0 : a.idx;
        s_inv_t = active ? inverse_temperature(p.temperature[r]) : 1.0f;
        s_top_k = p.top_k != nullptr ? p.top_k[r] : 0;
        s_top_p = p.top_p != nullptr ? p.top_p[r] : 1.0f;
      }
    }
    __syncthreads();
    if (s_active) {
      const float inv_t = s_inv_t, m = s_m, top_p = s_top_p;
      const int32_t top_k = s_top_k;
      const char* rp = row_ptr(p, row, Elem<D>::kSize);
      uint32_t kk = 0;  // top-k threshold key (0 keeps everything)
      // Radix select, most significant digit first: shifts 21, 10, 0 with 11, 11, 10 bits.
      const int kShift[3] = {21, 10, 0};
      const int kBits[3] = {11, 11, 10};
      if (top_k_active(top_k, p.vocab_size)) {
        uint32_t prefix = 0, pmask = 0;
        unsigned long long rank = static_cast<unsigned long long>(top_k);
        for (int level = 0; level < 3; ++level) {
          const int shift = kShift[level], bins = 1 << kBits[level];
          const uint32_t dmask = static_cast<uint32_t>(bins - 1);
          for (int b = threadIdx.x; b < bins; b += blockDim.x) s_cnt[b] = 0;
          __syncthreads();
          visit_row<D>(rp, p.vocab_size, 0, 1, [&](int32_t, const float* x, auto cnt) {
            constexpr int kN = decltype(cnt)::value;
#pragma unroll
            for (int k = 0; k < kN; ++k) {
              const uint32_t key = score_key(score_of(x[k], inv_t));
              if ((key & pmask) == prefix) atomicAdd(&s_cnt[(key >> shift) & dmask], 1u);
            }
          });
          __syncthreads();
          if (warp == 0) {
            int digit;
            unsigned long long above;
            find_digit<false>(s_cnt, nullptr, bins, rank, 0.0, 0, &digit, &above);
            if (lane == 0) {
              s_digit = digit < 0 ? 0 : digit;  // cannot happen: 1 <= rank <= elements
              s_above = above;
            }
          }
          __syncthreads();
          const uint32_t d = static_cast<uint32_t>(s_digit);
          rank -= s_above;
          prefix |= d << shift;
          pmask |= dmask << shift;
          const bool whole_bucket = s_cnt[d] == rank;  // every element of the bucket is kept
          __syncthreads();
          if (whole_bucket) break;
        }
        kk = prefix;
      }
      unsigned long long z_fixed = 0;
      uint32_t key_final = kk;
      if (top_p_active(top_p)) {
        uint32_t prefix = 0, pmask = 0;
        unsigned long long above = 0;
        double target = 0.0;
        for (int level = 0; level < 3; ++level) {
          const int shift = kShift[level], bins = 1 << kBits[level];
          const uint32_t dmask = static_cast<uint32_t>(bins - 1);
          for (int b = threadIdx.x; b < bins; b += blockDim.x) {
            s_cnt[b] = 0;
            s_mass[b] = 0;
          }
          __syncthreads();
          visit_row<D>(rp, p.vocab_size, 0, 1, [&](int32_t, const float* x, auto cnt) {
            constexpr int kN = decltype(cnt)::value;
#pragma unroll
            for (int k = 0; k < kN; ++k) {
              const float s = score_of(x[k], inv_t);
              const uint32_t key = score_key(s);
              if (key >= kk && (key & pmask) == prefix) {
                const uint32_t d = (key >> shift) & dmask;
                atomicAdd(&s_cnt[d], 1u);
                const unsigned long long w = fixed_mass(weight_of(s, m));
                if (w) atomicAdd(&s_mass[d], w);
              }
            }
          });
          __syncthreads();
          if (level == 0) {  // target = top_p * (mass kept by top-k)
            unsigned long long t = 0;
            for (int b = threadIdx.x; b < bins; b += blockDim.x) t += s_mass[b];
            for (int d = kWarp / 2; d > 0; d >>= 1) t += __shfl_xor_sync(0xffffffffu, t, d);
            if (lane == 0) s_red[warp] = t;
            __syncthreads();
            if (threadIdx.x == 0) {
              unsigned long long tot = 0;
              for (int w = 0; w < kFilterThreads / kWarp; ++w) tot += s_red[w];
              s_above = tot;
            }
            __syncthreads();
            target = static_cast<double>(top_p) * static_cast<double>(s_above);
            __syncthreads();
          }
          if (warp == 0) {
            int digit;
            unsigned long long higher;
            find_digit<true>(s_cnt, s_mass, bins, 0, target, above, &digit, &higher);
            if (lane == 0) {
              s_digit = digit < 0 ? bins - 1 : digit;
              s_above = higher;
            }
          }
          __syncthreads();
          const uint32_t d = static_cast<uint32_t>(s_digit);
          above += s_above;
          prefix |= d << shift;
          pmask |= dmask << shift;
          const bool single = s_cnt[d] <= 1;
          z_fixed = above + s_mass[d];
          __syncthreads();
          if (single) break;
        }
        key_final = prefix > kk ? prefix : kk;
      } else {  // top-k only: kept mass by a block reduction (integer, order-independent)
        unsigned long long t = 0;
        visit_row<D>(rp, p.vocab_size, 0, 1, [&](int32_t, const float* x, auto cnt) {
          constexpr int kN = decltype(cnt)::value;
#pragma unroll
          for (int k = 0; k < kN; ++k) {
            const float s = score_of(x[k], inv_t);
            if (score_key(s) >= kk) t += fixed_mass(weight_of(s, m));
          }
        });
        for (int d = kWarp / 2; d > 0; d >>= 1) t += __shfl_xor_sync(0xffffffffu, t, d);
        if (lane == 0) s_red[warp] = t;
        __syncthreads();
        if (threadIdx.x == 0) {
          unsigned long long tot = 0;
          for (int w = 0; w < kFilterThreads / kWarp; ++w) tot += s_red[w];
          s_above = tot;
        }
        __syncthreads();
        z_fixed = s_above;
      }
      if (threadIdx.x == 0) {
        RowStats st;
        st.m = m;
        st.key = key_final;
        st.z = static_cast<double>(z_fixed) / kMassScale;
        st.first_max = s_first_max;
        stats[row] = st;
      }
    }
    __syncthreads();
  }
}

// ---- 3. acceptance chain -----------------------------------------------------------------------

struct RowDistGpu {
  float m;
  uint32_t key;  // kept iff score_key(s) >= key
  double z;
  int32_t first_max;
};

__device__ RowDistGpu row_dist(const VerifyChainParams& p, const RowPartial* parts, int nsplit,
                               const RowStats* stats, int64_t row, bool filtered) {
  RowDistGpu d;
  if (filtered) {
    const RowStats st = stats[row];
    d.m = st.m;
    d.key = st.key;
    d.z = st.z;
    d.first_max = st.first_max;
    return d;
  }
  const int lane = threadIdx.x % kWarp;
  Mzi a{-INFINITY, 0.0f, -1};
  for (int s = lane; s < nsplit; s += kWarp) {
    const RowPartial q = parts[row * nsplit + s];
    a = merge_mzi(a, Mzi{q.m, q.z, q.idx});
  }
  a = warp_mzi(a);
  d.m = __shfl_sync(0xffffffffu, a.m, 0);
  d.z = static_cast<double>(__shfl_sync(0xffffffffu, a.z, 0));
  const int32_t idx = __shfl_sync(0xffffffffu, a.idx, 0);
  d.first_max = idx < 0 ? 0 : idx;
  d.key = 0;
  return d;
}

__device__ int32_t row_argmax_gpu(const RowPartial* parts, int nsplit, int64_t row) {
  const int lane = threadIdx.x % kWarp;
  ArgMax a = argmax_none();
  for (int s = lane; s < nsplit; s += kWarp) {
    const RowPartial q = parts[row * nsplit + s];
    a = argmax_merge(a, ArgMax{q.m, q.idx});
  }
  a = warp_argmax(a);
  const int32_t idx = __shfl_sync(0xffffffffu, a.idx, 0);
  return idx < 0 ? 0 : idx;
}

// One CTA per request; warp w evaluates rows w, w + 8, ... of a chunk of up to 32 rows in
// parallel (merge partials, greedy argmax or p(x) and the acceptance test), then thread 0 finds
// the first rejection. Later chunks are evaluated only if the whole chunk was accepted.
__global__ void __launch_bounds__(kDecideThreads)
    decide_kernel(const VerifyChainParams p, const RowPartial* __restrict__ parts, int nsplit,
                  const RowStats* __restrict__ stats, Decision* __restrict__ decisions) {
  __shared__ int32_t s_tok[kDecideChunk];  // greedy: argmax of the row
  __shared__ int32_t s_acc[kDecideChunk];  // draft rows: accepted?
  __shared__ RowDistGpu s_dist[kDecideChunk];
  __shared__ int32_t s_first_reject;
  __shared__ Decision s_dec;
  __shared__ int32_t s_last;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int32_t width = p.max_num_draft_tokens + 1;
  for (int64_t r64 = blockIdx.x; r64 < p.num_reqs; r64 += gridDim.x) {
    const int32_t r = static_cast<int32_t>(r64);
    const RequestSpan span = request_span(p.cu_num_draft_tokens, r, p.num_draft_tokens);
    const int32_t n = min(span.num_drafts, p.max_num_draft_tokens);
    const int32_t* drafts = p.draft_token_ids + span.first_draft;
    const bool real = request_is_real(p, r);
    if (threadIdx.x == 0) {
      Decision dec;
      dec.mode = kModeDone;
      dec.accepted = 0;
      dec.exclude = -1;
      dec.first_max = 0;
      dec.row = 0;
      dec.q_row = -1;
      dec.m = 0.0f;
      dec.inv_t = 1.0f;
      dec.zf = 1.0f;
      dec.key = 0;
      s_dec = dec;
      s_last = kPlaceholderTokenId;
    }
    __syncthreads();
    if (real) {
      const float temp = p.temperature[r];
      const bool greedy = is_greedy_temperature(temp);
      const bool filtered = !greedy && request_is_filtered(p, r);
      const float inv_t = greedy ? 1.0f : inverse_temperature(temp);
      for (int32_t c0 = 0; c0 <= n; c0 += kDecideChunk) {
        const int32_t c1 = min(c0 + kDecideChunk, n + 1);
        for (int32_t j = c0 + warp; j < c1; j += kDecideWarps) {
          // Row j < n: draft row; j == n: the bonus row.
          const int64_t row = span.first_row + (j < n ? j : span.num_drafts);
          int32_t acc = 0;
          if (greedy) {
            const int32_t a = row_argmax_gpu(parts, nsplit, row);
            acc = j < n && drafts[j] == a;
            if (lane == 0) s_tok[j - c0] = a;
          } else {
            const RowDistGpu d = row_dist(p, parts, nsplit, stats, row, filtered);
            if (lane == 0) {
              s_dist[j - c0] = d;
              if (j < n) {
                const int32_t x = drafts[j];
                const int64_t draft_index = span.first_draft + j;
                const bool valid = x >= 0 && x < p.vocab_size;
                double p_x = 0.0;
                if (valid) {
                  const float s = score_of(
                      load_logit(p.logits, p.logits_dtype, row * p.logits_row_stride + x), inv_t);
                  if (score_key(s) >= d.key) p_x = static_cast<double>(weight_of(s, d.m)) / d.z;
                }
                double q_x = 1.0;
                if (p.draft_probs != nullptr) {
                  q_x = valid ? static_cast<double>(
                                    p.draft_probs[draft_index * p.draft_probs_row_stride + x])
                              : 0.0;
                }
                const double u =
                    p.uniforms != nullptr
                        ? p.uniforms[draft_index]
                        : acceptance_uniform(p.seeds[r], p.offsets[r], static_cast<uint32_t>(j));
                acc = accept_draft(u, p_x, q_x);
              }
            }
          }
          if (lane == 0) s_acc[j - c0] = acc;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
          int32_t fr = -1;
          for (int32_t j = c0; j < min(c1, n); ++j) {
            if (!s_acc[j - c0]) {
              fr = j;
              break;
            }
          }
          s_first_reject = fr;
          if (fr >= 0 || c1 == n + 1) {
            const int32_t j = fr >= 0 ? fr : n;  // the row that yields the last token
            Decision dec = s_dec;
            dec.accepted = j;
            if (greedy) {
              s_last = s_tok[j - c0];
            } else {
              const RowDistGpu d = s_dist[j - c0];
              dec.mode = fr >= 0 ? kModeRecovered : kModeBonus;
              dec.row = span.first_row + (fr >= 0 ? fr : span.num_drafts);
              dec.exclude = fr >= 0 && p.draft_probs == nullptr ? drafts[fr] : -1;
              dec.q_row = fr >= 0 && p.draft_probs != nullptr ? span.first_draft + fr : -1;
              dec.m = d.m;
              dec.key = d.key;
              dec.zf = static_cast<float>(d.z);
              dec.first_max = d.first_max;
              dec.inv_t = inv_t;
            }
            s_dec = dec;
          }
        }
        __syncthreads();
        const bool done = s_first_reject >= 0 || c1 == n + 1;
        __syncthreads();
        if (done) break;
      }
    }
    // Outputs: the accepted prefix, the greedy correction/bonus (random: finalize), then -1.
    const Decision dec = s_dec;
    const int32_t accepted = dec.accepted;
    int32_t* out = p.output_token_ids + r64 * width;
    for (int32_t c = threadIdx.x; c < width; c += blockDim.x) {
      int32_t v = kPlaceholderTokenId;
      if (real && c < accepted) v = drafts[c];
      if (real && c == accepted && dec.mode == kModeDone) v = s_last;
      out[c] = v;
    }
    if (p.accepted_per_position != nullptr) {
      bool* app = p.accepted_per_position + r64 * p.max_num_draft_tokens;
      for (int32_t c = threadIdx.x; c < p.max_num_draft_tokens; c += blockDim.x) {
        app[c] = c < accepted;
      }
    }
    if (threadIdx.x == 0) {
      p.num_accepted[r] = accepted;
      decisions[r] = dec;
    }
    __syncthreads();
  }
}

// ---- 4. Gumbel-max sampling of the one row per request that needs a token ---------------------

template <LogitsDtype D>
__global__ void __launch_bounds__(kSampleThreads)
    sample_kernel(const VerifyChainParams p, const Decision* __restrict__ decisions,
                  ArgMax* __restrict__ samples, int nsplit) {
  __shared__ ArgMax s_warp[kSampleThreads / kWarp];
  const int split = blockIdx.x;
  const int32_t groups = (p.vocab_size + 3) / 4;
  for (int64_t r = blockIdx.y; r < p.num_reqs; r += gridDim.y) {
    const Decision dec = decisions[r];
    if (dec.mode == kModeDone) continue;  // uniform across the block
    const uint32_t stream = dec.mode == kModeBonus ? kStreamBonus : kStreamRecovered;
    const int64_t seed = p.seeds[r], offset = p.offsets[r];
    const char* rp = row_ptr(p, dec.row, Elem<D>::kSize);
    const float* q =
        dec.q_row >= 0 ? p.draft_probs + dec.q_row * p.draft_probs_row_stride : nullptr;
    // A lower bound on the winner's value when the row's maximum is itself a candidate.
    float bound = -INFINITY;
    if (q == nullptr && dec.first_max != dec.exclude && isfinite(dec.m)) bound = dec.m - kGumbelMin;
    ArgMax best = argmax_none();
    const int32_t gb = static_cast<int32_t>(static_cast<int64_t>(groups) * split / nsplit);
    const int32_t ge = static_cast<int32_t>(static_cast<int64_t>(groups) * (split + 1) / nsplit);
    for (int32_t g = gb + threadIdx.x; g < ge; g += blockDim.x) {
      const int32_t v0 = 4 * g;
      float val[4];
      bool need = false;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int32_t v = v0 + k;
        val[k] = -INFINITY;
        if (v >= p.vocab_size) continue;
        const float s = score_of(load_scalar<D>(rp, v), dec.inv_t);
        const bool kept = score_key(s) >= dec.key;
        if (q != nullptr) {
          const float pv = kept ? weight_of(s, dec.m) / dec.zf : 0.0f;
          const float res = pv - __ldg(q + v);
          if (res > 0.0f) val[k] = logf(res);
        } else if (kept && v != dec.exclude) {
          val[k] = s;
        }
        const float lim = fmaxf(best.val, bound);
        if (val[k] > -INFINITY && !(val[k] + kGumbelMax < lim)) need = true;
      }
      if (!need) continue;
      float gn[4];
      gumbel4(seed, offset, static_cast<uint32_t>(g), stream, gn);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (val[k] > -INFINITY) argmax_push(best, val[k] + gn[k], v0 + k);
      }
    }
    best = warp_argmax(best);
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
    if (lane == 0) s_warp[warp] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
      ArgMax t = s_warp[0];
      for (int w = 1; w < kSampleThreads / kWarp; ++w) t = argmax_merge(t, s_warp[w]);
      samples[r * nsplit + split] = t;
    }
    __syncthreads();
  }
}

// ---- 5. finalize -------------------------------------------------------------------------------

__global__ void __launch_bounds__(kWarpsPerReqBlock* kWarp)
    finalize_kernel(const VerifyChainParams p, const Decision* __restrict__ decisions,
                    const ArgMax* __restrict__ samples, int nsplit) {
  const int lane = threadIdx.x % kWarp;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerReqBlock + threadIdx.x / kWarp;
  if (r >= p.num_reqs) return;
  const Decision dec = decisions[r];
  if (dec.mode == kModeDone) return;
  ArgMax a = argmax_none();
  for (int s = lane; s < nsplit; s += kWarp) a = argmax_merge(a, samples[r * nsplit + s]);
  a = warp_argmax(a);
  if (lane == 0) {
    const int32_t tok = a.idx < 0 ? dec.first_max : a.idx;
    p.output_token_ids[r * (p.max_num_draft_tokens + 1) + dec.accepted] = tok;
  }
}

template <LogitsDtype D>
cudaError_t launch_typed(const VerifyChainParams& p, const Layout& l, char* ws,
                         cudaStream_t stream) {
  auto* parts = reinterpret_cast<RowPartial*>(ws + l.off_partials);
  auto* stats = reinterpret_cast<RowStats*>(ws + l.off_stats);
  auto* decisions = reinterpret_cast<Decision*>(ws + l.off_decisions);
  auto* samples = reinterpret_cast<ArgMax*>(ws + l.off_samples);
  const int grid_rows = static_cast<int>(p.num_rows < kMaxGridY ? p.num_rows : kMaxGridY);
  const int grid_reqs = p.num_reqs < kMaxGridY ? p.num_reqs : kMaxGridY;
  row_stats_kernel<D><<<dim3(l.splits, grid_rows), kStatsThreads, 0, stream>>>(p, parts, l.splits);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (p.top_k != nullptr || p.top_p != nullptr) {
    const int grid = static_cast<int>(p.num_rows < (1 << 20) ? p.num_rows : (1 << 20));
    row_filter_kernel<D><<<grid, kFilterThreads, 0, stream>>>(p, parts, l.splits, stats);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  const int req_blocks = (p.num_reqs + kWarpsPerReqBlock - 1) / kWarpsPerReqBlock;
  const int decide_blocks = p.num_reqs < (1 << 20) ? p.num_reqs : (1 << 20);
  decide_kernel<<<decide_blocks, kDecideThreads, 0, stream>>>(p, parts, l.splits, stats, decisions);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  sample_kernel<D><<<dim3(l.sample_splits, grid_reqs), kSampleThreads, 0, stream>>>(
      p, decisions, samples, l.sample_splits);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  finalize_kernel<<<req_blocks, kWarpsPerReqBlock * kWarp, 0, stream>>>(p, decisions, samples,
                                                                        l.sample_splits);
  return cudaGetLastError();
}

}  // namespace

size_t verify_chain_workspace_bytes(const VerifyChainParams& p) {
  return plan(p).total;
}

cudaError_t launch_verify_chain(const VerifyChainParams& p, void* workspace, cudaStream_t stream) {
  if (p.num_reqs <= 0) return cudaSuccess;
  const Layout l = plan(p);
  char* ws = static_cast<char*>(workspace);
  switch (p.logits_dtype) {
    case LogitsDtype::kBFloat16:
      return launch_typed<LogitsDtype::kBFloat16>(p, l, ws, stream);
    case LogitsDtype::kFloat16:
      return launch_typed<LogitsDtype::kFloat16>(p, l, ws, stream);
    default:
      return launch_typed<LogitsDtype::kFloat32>(p, l, ws, stream);
  }
}

}  // namespace peagle
