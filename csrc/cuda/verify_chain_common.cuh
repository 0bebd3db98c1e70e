// Device helpers shared by the verify_chain kernels (torch-free; included by verify_chain.cu
// only): constants, workspace records, programmatic-dependent-launch hooks, fast exp2, logits
// loads, warp reductions and the row -> request lookup.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "peagle/kernels/verify_chain.h"

namespace peagle {
namespace {

constexpr int kWarp = 32;
constexpr int kThreads = 256;  // every verify_chain kernel
constexpr int kWarps = kThreads / kWarp;
constexpr int kMaxGridY = 65535;
constexpr int kCandCap = 4096;   // row_filter: candidate keys kept per row at most (shared memory)
constexpr int kMinCandCap = 32;  // ... and at least (fewer only when R is huge, see plan())
constexpr size_t kCandPoolBytes = size_t(64) << 20;  // candidate buffers of all rows
// Top-k candidates collected in row_stats (PEAGLE_VERIFY_TOPK_IN_STATS=1): rows with
// top_k <= kStatsTopK; every thread keeps its kThreadTop largest scores, every split writes at most
// kStatsCandCap candidate keys (ties can make more than top_k; more: the row takes row_filter's
// usual path).
constexpr int kStatsTopK = 64;
constexpr int kThreadTop = 4;
constexpr int kStatsCandCap = 128;
constexpr uint32_t kStatsOverflow = 0xffffffffu;
// Filtered rows: row_stats writes a record of every group of kGroupVecs consecutive vectors of a
// thread (group_max, group_record), so row_filter reads only the vectors that may reach its bound.
constexpr int kGroupVecs = 16;  // a power of two (the record keeps the vector index in 4 bits)
// Group path: row_filter also writes every filtered row's kept set (token, key) sorted by token
// when it has at most kKeptCap tokens, so decide_sample draws from it without reading the row.
constexpr int kKeptCap = 256;
constexpr uint32_t kKeptNone = 0xffffffffu;  // kept_n: no list (the tiled path reads the row)
constexpr float kLog2e = 1.4426950408889634f;
constexpr double kMassScale = 4294967296.0;  // 2^32 fixed point for kept masses (e <= 1)

// Per-row mode, decided once per row by row_info().
enum : int32_t { kRowSkip = 0, kRowGreedy = 1, kRowRandom = 2, kRowFiltered = 3 };

struct RowPartial {  // row_stats output: one split of one row
  float m;           // max score (greedy rows: max logit); -inf if none is finite
  float z;           // sum of 2^((s - m) log2 e) (random rows only)
  int32_t idx;       // first index of the max (-1 if none)
  float bound;       // top-k rows: k-th largest per-thread maximum of the split (-inf: none)
};

// Per split of a row with stats candidates: the split wrote `n` keys (kStatsOverflow: unusable),
// among them every element of the split with key >= `bound`; n >= top_k ones are all >= bound.
struct TopkMeta {
  uint32_t n;
  uint32_t bound;
};

struct RowStats {  // row_filter output for rows with top-k / top-p
  float m;
  uint32_t key;  // kept iff score_key(s) >= key
  double z;      // kept mass
  int32_t first_max;
  int32_t pad[3];
};

// The outcome of a request's acceptance chain (decide_sample; the fused kernel's deciding CTA
// publishes it for the sampling items of the request).
struct Decision {
  int32_t mode;
  int32_t accepted;
  int32_t exclude;    // draft id excluded from the recovered token (no draft_probs), else -1
  int32_t first_max;  // fallback when no candidate exists
  int32_t last;       // kModeDone: the token after the accepted prefix
  uint32_t key;
  int64_t row;    // logits row to sample
  int64_t q_row;  // draft_probs row for the residual, -1 without
  float m;
  float zf;
  float exclude_score;  // the excluded draft's score (chunk sampling)
};

// Scratch of one call. Unfused path: counters are zeroed by row_stats (the first kernel) and
// consumed by the later kernels, which read them only after griddepcontrol.wait, so the per-call
// workspace from the caching allocator never needs a memset. Fused path (one kernel): the
// counters live in a persistent buffer the glue zeroes once; the kernel leaves them zeroed (each
// is reset by the last CTA that uses it), so every launch and every graph replay finds zeros.
struct Workspace {
  RowPartial* parts;          // [R, nsplit]
  RowStats* stats;            // [R] (filtering only)
  uint32_t* cand_count;       // [R] (filtering only): candidate keys appended per row
  uint32_t* filter_arrivals;  // [R] (filtering only): row_filter CTAs done per row
  uint32_t* cand_keys;        // [R, cand_cap] (filtering only)
  uint32_t* sample_arrivals;  // [B]: sampling CTAs done per request
  ArgMax* samples;            // [B, nsample]: partial exponential-race argmax per sampling CTA
  double* tile_mass;          // [B, tiles_per_req]: inverse-CDF tile masses of the sampled row
  // Chunk sampling only (null otherwise): row_stats' per-warp (max score, sum of
  // 2^((s - max) log2 e)) of random rows, one per chunk (chunk_range), so decide_sample reads
  // only the chunk that holds the draw (and the excluded draft's chunk).
  float2* chunk_mz;  // [R, nsplit * kWarps]
  int64_t tiles_per_req;
  int32_t nsplit;    // CTAs per row in row_stats / row_filter
  int32_t nsample;   // CTAs per request in decide_sample
  int32_t cand_cap;  // candidate keys per row (else the radix fallback)
  int32_t rank_max;  // row_filter ranks at most this many candidates (else radix digits)
  bool exact_bound;  // top-k bound: the split's exact k-th largest thread maximum (else per warp)
  // Filtered rows on the group path (null otherwise): a record (group_record) of every thread's
  // group of kGroupVecs vectors; slot j * kWarp + lane of chunk c holds lane's vectors
  // vb + lane + kWarp * (j * kGroupVecs + u), u < kGroupVecs (chunk_range).
  uint2* group_max;     // [R, nsplit * kWarps, group_slots]
  int32_t group_slots;  // per chunk: kWarp * ceil(largest chunk's vectors / (kWarp * kGroupVecs))
  // Group path with kept sampling (null otherwise; PEAGLE_VERIFY_KEPT_SAMPLING=0 turns it off):
  // per filtered row, its kept tokens and keys sorted by token (kept_n of them, or kKeptNone).
  uint2* kept;       // [R, kKeptCap]: (token, score key)
  uint32_t* kept_n;  // [R]
  // PEAGLE_VERIFY_TOPK_IN_STATS=1 with filtering (null otherwise): row_stats' top-k candidates.
  uint32_t* topk_cand;  // [R, nsplit, kStatsCandCap]
  TopkMeta* topk_meta;  // [R, nsplit]
  // Fused path only (null / 0 otherwise).
  unsigned long long* next_item;  // persistent: work items handed out so far
  uint32_t* exited;               // persistent: CTAs past their last item
  uint32_t* stats_arrivals;       // persistent [B]: stats items done per request
  uint32_t* decided;              // persistent [B]: 0 pending, 1 sample, 2 nothing to sample
  Decision* decisions;            // per call [B]
  int64_t total_items;            // stats items + sampling items
  int32_t lag;                    // sampling items of request r follow the stats items of r + lag
};

// A logits-row partial written by another CTA of the same kernel (fused path) or by an earlier
// kernel: read through L2 (never a stale L1 line). Same bits as a plain load.
__device__ __forceinline__ RowPartial load_part(const RowPartial* ptr) {
  const float4 v = __ldcg(reinterpret_cast<const float4*>(ptr));
  RowPartial q;
  q.m = v.x;
  q.z = v.y;
  q.idx = __float_as_int(v.z);
  q.bound = v.w;
  return q;
}

// ---- programmatic dependent launch (sm_90+) --------------------------------------------------

// Lets the next kernel (launched with the programmatic attribute) be scheduled now; it still
// waits in pdl_wait() for this grid's completion and memory flush before reading its outputs.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Waits for the previous kernel (a no-op without the attribute). Every CTA of a kernel launched
// with the attribute calls it before exiting, so the grid never completes ahead of its
// predecessor (the op's workspace is freed when the last kernel completes).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// ---- arithmetic --------------------------------------------------------------------------------

// 2^x with one MUFU.EX2 (relative error ~2^-22; flushes results below 2^-126 to 0). Deterministic.
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The CUDA kernels' normaliser terms: e ~= exp(s - m) computed as 2^(s log2 e - m log2 e) with one
// FFMA and one MUFU.EX2; `ml` = m * kLog2e. NaN scores and NaN differences (inf - inf) give 0.
__device__ __forceinline__ float fast_weight(float s, float ml) {
  return ex2_approx(fmaxf(fmaf(s, kLog2e, -ml), -INFINITY));
}

// 2^-32 fixed point of a weight e in [0, 1]; NaN -> 0.
__device__ __forceinline__ unsigned long long fixed_mass(float e) {
  return e > 0.0f ? __float2ull_rn(e * 4294967296.0f) : 0ull;
}

// Key of a score for the kept-set threshold: -0 and +0 compare equal as floats, so map -0 -> +0.
__device__ __forceinline__ uint32_t score_key(float s) {
  return ordered_key(s + 0.0f);
}

__device__ __forceinline__ uint32_t lanemask_lt() {
  uint32_t m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// ---- logits access -----------------------------------------------------------------------------

template <LogitsDtype D>
struct Elem {
  static constexpr int kSize = D == LogitsDtype::kFloat32 ? 4 : 2;
  static constexpr int kPerVec = 16 / kSize;  // elements per 16-byte vector
};

__device__ __forceinline__ const char* row_ptr(const VerifyChainParams& p, int64_t row, int es) {
  return static_cast<const char*>(p.logits) + row * p.logits_row_stride * es;
}

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

// Read-once 16-byte load: no L1 allocation, 256-byte L2 prefetch. `volatile` keeps the load
// under its guard (the compiler must not speculate it past a bounds check).
__device__ __forceinline__ uint4 ld_stream16(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

__device__ __forceinline__ uint2 ld_stream8(const void* ptr) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0, %1}, [%2];"
               : "=r"(v.x), "=r"(v.y)
               : "l"(ptr));
  return v;
}

__device__ __forceinline__ float half_bits_to_float(uint32_t h) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
}

// `n` 32-bit words of a vector -> floats (1 per word for fp32, 2 per word for 16-bit types).
template <LogitsDtype D, int kWords>
__device__ __forceinline__ void unpack_words(const uint32_t* w, float* out) {
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    if constexpr (D == LogitsDtype::kFloat32) {
      out[i] = __uint_as_float(w[i]);
    } else if constexpr (D == LogitsDtype::kBFloat16) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      out[2 * i] = half_bits_to_float(w[i] & 0xffffu);
      out[2 * i + 1] = half_bits_to_float(w[i] >> 16);
    }
  }
}

// The aligned body of a row: `head` scalars before the first 16-byte boundary, then `nvec`
// 16-byte vectors, then scalars from `body_end` to the end of the row.
struct RowBody {
  int32_t head, nvec, body_end;
};

template <LogitsDtype D>
__device__ __forceinline__ RowBody row_body(const char* row, int32_t vocab) {
  constexpr int kEs = Elem<D>::kSize, kEpv = Elem<D>::kPerVec;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(row);
  RowBody b;
  b.head = static_cast<int32_t>(((16 - (addr & 15)) & 15) / kEs);
  if (b.head > vocab) b.head = vocab;
  b.nvec = (vocab - b.head) / kEpv;
  b.body_end = b.head + b.nvec * kEpv;
  return b;
}

// Chunk c = split * kWarps + warp of a row: the vectors [vb, ve) of warp `warp` of split `split`
// (stream_split's partition), as token range [lo, hi); chunk 0 also holds the head, the last
// chunk the tail, so the chunks tile [0, vocab) in order.
struct ChunkRange {
  int32_t lo, hi;  // tokens
  int32_t vb, ve;  // body vectors
};

template <LogitsDtype D>
__device__ __forceinline__ ChunkRange chunk_range(const RowBody& b, int32_t vocab, int split,
                                                  int nsplit, int warp) {
  constexpr int kEpv = Elem<D>::kPerVec;
  const int64_t sb = static_cast<int64_t>(b.nvec) * split / nsplit;
  const int64_t n = static_cast<int64_t>(b.nvec) * (split + 1) / nsplit - sb;
  ChunkRange c;
  c.vb = static_cast<int32_t>(sb + n * warp / kWarps);
  c.ve = static_cast<int32_t>(sb + n * (warp + 1) / kWarps);
  c.lo = split == 0 && warp == 0 ? 0 : b.head + c.vb * kEpv;
  c.hi = split == nsplit - 1 && warp == kWarps - 1 ? vocab : b.head + c.ve * kEpv;
  return c;
}

// This warp's group records (chunk `split * kWarps + warp` of `row`), lane 0's first.
__device__ __forceinline__ uint2* group_max_of_chunk(const Workspace& ws, int64_t row, int split,
                                                     int warp) {
  return ws.group_max + (row * ws.nsplit * kWarps + split * kWarps + warp) * ws.group_slots;
}

// A group's record: x = score_key(g1) rounded up to a multiple of kGroupVecs, plus the index u of
// the vector holding g1 (the largest score of the group); y = score_key(g2), g2 the largest score
// of the other vectors. x >= score_key(g1), so a group with a score >= t has x >= score_key(t);
// when y < score_key(t), only vector u can hold such a score (keys order scores as floats, -0 and
// +0 alike).
__device__ __forceinline__ uint2 group_record(float g1, int u, float g2) {
  constexpr uint32_t kLow = kGroupVecs - 1;
  const uint32_t k1 = ((score_key(g1) + kLow) & ~kLow) | static_cast<uint32_t>(u);
  return make_uint2(k1, score_key(g2));
}

// Calls f(v0, vals, std::integral_constant<int, N>) over this CTA's share (split of nsplit) of a
// row of `vocab` elements. Warp w of the CTA takes chunk (split, w) of chunk_range: a contiguous
// run of 16-byte vectors, lane-strided (a warp load covers 512 contiguous bytes), plus the
// unaligned head (chunk 0) or tail (last chunk) as scalars. Contiguous chunks let row_stats'
// per-warp sums serve as inverse-CDF masses. Each thread sees its elements in increasing index
// order, so a strict `>` keeps the first index of a maximum. The body is software-pipelined:
// the next kU vectors per thread are in flight while the current ones are processed.
template <LogitsDtype D, typename F>
__device__ __forceinline__ void stream_split(const char* row, int32_t vocab, int split, int nsplit,
                                             F&& f) {
  constexpr int kEpv = Elem<D>::kPerVec, kU = 4;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const RowBody b = row_body<D>(row, vocab);
  const ChunkRange c = chunk_range<D>(b, vocab, split, nsplit, warp);
  const char* body = row + static_cast<int64_t>(b.head) * Elem<D>::kSize;
  if (split == 0 && warp == 0) {
    for (int32_t v = lane; v < b.head; v += kWarp) {
      float x[1] = {load_scalar<D>(row, v)};
      f(v, x, std::integral_constant<int, 1>{});
    }
  }
  int32_t i = c.vb + lane;
  uint4 cur[kU];
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int32_t k = i + u * kWarp;
    cur[u] = k < c.ve ? ld_stream16(body + static_cast<int64_t>(k) * 16) : make_uint4(0, 0, 0, 0);
  }
  while (i < c.ve) {
    const int32_t inext = i + kU * kWarp;
    uint4 nxt[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int32_t k = inext + u * kWarp;
      nxt[u] = k < c.ve ? ld_stream16(body + static_cast<int64_t>(k) * 16) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int32_t k = i + u * kWarp;
      if (k < c.ve) {
        const uint32_t w[4] = {cur[u].x, cur[u].y, cur[u].z, cur[u].w};
        float vals[kEpv];
        unpack_words<D, 4>(w, vals);
        f(b.head + k * kEpv, vals, std::integral_constant<int, kEpv>{});
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) cur[u] = nxt[u];
    i = inext;
  }
  if (split == nsplit - 1 && warp == kWarps - 1) {
    for (int32_t v = b.body_end + lane; v < vocab; v += kWarp) {
      float x[1] = {load_scalar<D>(row, v)};
      f(v, x, std::integral_constant<int, 1>{});
    }
  }
}

// As stream_split, but over the vectors that may hold a score >= t (t > -inf) by the group
// records of this warp's chunk (`gr`, group_record): every vector of a group whose y reaches
// key(t), else only the vector holding the group's maximum when its x does; plus the head and
// tail scalars. The records are loaded 8 at a time (one round trip for up to 8 groups per lane).
template <LogitsDtype D, typename F>
__device__ __forceinline__ void scan_groups(const char* row, int32_t vocab, int split, int nsplit,
                                            const uint2* gr, float t, F&& f) {
  constexpr int kEpv = Elem<D>::kPerVec, kBatch = 8;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const RowBody b = row_body<D>(row, vocab);
  const ChunkRange c = chunk_range<D>(b, vocab, split, nsplit, warp);
  const char* body = row + static_cast<int64_t>(b.head) * Elem<D>::kSize;
  if (split == 0 && warp == 0) {
    for (int32_t v = lane; v < b.head; v += kWarp) {
      float x[1] = {load_scalar<D>(row, v)};
      f(v, x, std::integral_constant<int, 1>{});
    }
  }
  const uint32_t key_t = score_key(t);
  auto visit = [&](int32_t k, const uint4& v) {  // body vector k (< c.ve), loaded
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    float vals[kEpv];
    unpack_words<D, 4>(w, vals);
    f(b.head + k * kEpv, vals, std::integral_constant<int, kEpv>{});
  };
  constexpr int32_t kSpan = kWarp * kGroupVecs;  // vectors of one row (j) of group slots
  const int32_t ngroups = (c.ve - c.vb + kSpan - 1) / kSpan;
  for (int32_t j0 = 0; j0 < ngroups; j0 += kBatch) {
    uint2 g[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int32_t j = j0 + u;
      const bool in = j < ngroups && c.vb + j * kSpan + lane < c.ve;
      g[u] = in ? __ldcg(gr + j * kWarp + lane) : make_uint2(0u, 0u);
    }
    uint32_t hits = 0, whole = 0;  // masks (no local-memory array)
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      hits |= static_cast<uint32_t>(g[u].x >= key_t) << u;
      whole |= static_cast<uint32_t>(g[u].y >= key_t) << u;
    }
    while (hits != 0) {
      const int u = __ffs(static_cast<int>(hits)) - 1;
      hits &= hits - 1;
      const int32_t k0 = c.vb + (j0 + u) * kSpan + lane;
      if ((whole >> u) & 1u) {  // 4 vectors in flight at a time
        constexpr int kIn = 4;
#pragma unroll 1
        for (int q0 = 0; q0 < kGroupVecs; q0 += kIn) {
          uint4 v[kIn];
#pragma unroll
          for (int q = 0; q < kIn; ++q) {
            const int32_t k = k0 + (q0 + q) * kWarp;
            v[q] = k < c.ve ? ld_stream16(body + static_cast<int64_t>(k) * 16)
                            : make_uint4(0, 0, 0, 0);
          }
#pragma unroll
          for (int q = 0; q < kIn; ++q) {
            const int32_t k = k0 + (q0 + q) * kWarp;
            if (k < c.ve) visit(k, v[q]);
          }
        }
      } else {
        uint32_t x = 0;  // g[u].x without a dynamically indexed register array
#pragma unroll
        for (int q = 0; q < kBatch; ++q) x = q == u ? g[q].x : x;
        const int32_t k = k0 + static_cast<int32_t>(x & (kGroupVecs - 1)) * kWarp;
        visit(k, ld_stream16(body + static_cast<int64_t>(k) * 16));
      }
    }
  }
  if (split == nsplit - 1 && warp == kWarps - 1) {
    for (int32_t v = b.body_end + lane; v < vocab; v += kWarp) {
      float x[1] = {load_scalar<D>(row, v)};
      f(v, x, std::integral_constant<int, 1>{});
    }
  }
}

// ---- reductions --------------------------------------------------------------------------------

__device__ __forceinline__ ArgMax shfl_down_argmax(ArgMax a, int delta) {
  ArgMax b;
  b.val = __shfl_down_sync(0xffffffffu, a.val, delta);
  b.idx = __shfl_down_sync(0xffffffffu, a.idx, delta);
  return b;
}

// Lane 0 gets the warp's first-index argmax.
__device__ __forceinline__ ArgMax warp_argmax(ArgMax a) {
#pragma unroll
  for (int d = kWarp / 2; d > 0; d >>= 1) a = argmax_merge(a, shfl_down_argmax(a, d));
  return a;
}

// (max, sum, argmax) of two partials; z is rescaled to the merged max (precise expf).
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

// Lane 0 gets the warp's merged (m, z, idx).
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

// Merge of the nsplit partials of a row by one warp (fixed order: lane-strided, then a shuffle
// tree). Every lane gets the result; `bound` is the max of the splits' bounds.
struct RowMerge {
  float m;
  float z;
  int32_t idx;  // -1 if no finite score
  float bound;
};

__device__ __forceinline__ RowMerge warp_merge_row(const RowPartial* parts, int nsplit,
                                                   int64_t row) {
  const int lane = threadIdx.x % kWarp;
  Mzi a{-INFINITY, 0.0f, -1};
  float bound = -INFINITY;
  for (int s = lane; s < nsplit; s += kWarp) {
    const RowPartial q = load_part(parts + row * nsplit + s);
    a = merge_mzi(a, Mzi{q.m, q.z, q.idx});
    bound = fmaxf(bound, q.bound);
  }
  a = warp_mzi(a);
#pragma unroll
  for (int d = kWarp / 2; d > 0; d >>= 1) {
    bound = fmaxf(bound, __shfl_xor_sync(0xffffffffu, bound, d));
  }
  RowMerge out;
  out.m = __shfl_sync(0xffffffffu, a.m, 0);
  out.z = __shfl_sync(0xffffffffu, a.z, 0);
  out.idx = __shfl_sync(0xffffffffu, a.idx, 0);
  out.bound = bound;
  return out;
}

// Block-wide exclusive prefix sum of one 64-bit value per thread (all threads must call);
// *total gets the block sum. s_tmp: kWarps entries of shared scratch.
__device__ __forceinline__ unsigned long long block_exclusive_scan(unsigned long long x,
                                                                   unsigned long long* s_tmp,
                                                                   unsigned long long* total) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  unsigned long long incl = x;
#pragma unroll
  for (int d = 1; d < kWarp; d <<= 1) {
    const unsigned long long y = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += y;
  }
  if (lane == kWarp - 1) s_tmp[warp] = incl;
  __syncthreads();
  unsigned long long before = 0, sum = 0;
  for (int w = 0; w < kWarps; ++w) {
    const unsigned long long t = s_tmp[w];
    if (w < warp) before += t;
    sum += t;
  }
  __syncthreads();  // s_tmp may be reused right after
  *total = sum;
  return before + incl - x;
}

// ---- requests ----------------------------------------------------------------------------------

__device__ __forceinline__ bool request_is_real(const VerifyChainParams& p, int32_t r) {
  return p.request_mask == nullptr || p.request_mask[r];
}

__device__ __forceinline__ bool request_is_filtered(const VerifyChainParams& p, int32_t r) {
  const bool k = p.top_k != nullptr && top_k_active(p.top_k[r], p.vocab_size);
  const bool tp = p.top_p != nullptr && top_p_active(p.top_p[r]);
  return k || tp;
}

// The request owning logits row `row` (the largest r with first_row(r) <= row), found by a 32-ary
// search: one round of loads per factor of 32 in B (B <= 33: one round). Whole warp, uniform
// result. Any input gives a result in [0, B).
__device__ int32_t request_of_row_warp(const VerifyChainParams& p, int64_t row) {
  const int lane = threadIdx.x % kWarp;
  int32_t lo = 0, hi = p.num_reqs - 1;
  while (lo < hi) {
    const int64_t span = static_cast<int64_t>(hi) - lo;
    const int32_t probe = lo + static_cast<int32_t>(((lane + 1) * span + kWarp - 1) / kWarp);
    const bool ok = request_span(p.cu_num_draft_tokens, probe, p.num_draft_tokens).first_row <= row;
    const uint32_t m = __ballot_sync(0xffffffffu, ok);
    if (m == 0) {
      hi = __shfl_sync(0xffffffffu, probe, 0) - 1;
    } else {
      const int last = 31 - __clz(static_cast<int>(m));
      const int32_t p_last = __shfl_sync(0xffffffffu, probe, last);
      const int32_t p_next = __shfl_sync(0xffffffffu, probe, last < 31 ? last + 1 : 31);
      lo = p_last;
      if (last < 31) hi = p_next - 1;  // probes of higher lanes are larger (see below)
    }
  }
  // Lanes with equal probes see equal results, so the lane after the last `ok` one probes a
  // larger request: hi >= lo always holds and the range shrinks every round.
  return lo;
}

struct RowInfo {
  int32_t r;
  int32_t mode;  // kRow*
  float inv_t;
  int32_t top_k;
  float top_p;
};

// Whether row_stats collects the row's top-k candidates (and row_filter may use them).
__device__ __forceinline__ bool stats_cands_row(const Workspace& ws, const RowInfo& info,
                                                int32_t vocab) {
  return ws.topk_meta != nullptr && info.mode == kRowFiltered && top_k_active(info.top_k, vocab) &&
         info.top_k <= kStatsTopK;
}

// Whole warp; every lane gets the same result.
__device__ RowInfo row_info(const VerifyChainParams& p, int64_t row) {
  RowInfo info;
  info.r = request_of_row_warp(p, row);
  info.mode = kRowSkip;
  info.inv_t = 1.0f;
  info.top_k = 0;
  info.top_p = 1.0f;
  const int32_t r = info.r;
  const RequestSpan span = request_span(p.cu_num_draft_tokens, r, p.num_draft_tokens);
  const int64_t j = row - span.first_row;  // 0 .. n_r - 1: draft rows; n_r: the bonus row
  const bool bonus_row = j == span.num_drafts;
  if (!request_is_real(p, r)) return info;
  if (bonus_row && p.bonus_token_ids != nullptr) return info;  // the bonus token is given
  if (!bonus_row && j >= p.max_num_draft_tokens) return info;  // never verified (n clamped)
  const float t = p.temperature[r];
  if (is_greedy_temperature(t)) {
    info.mode = kRowGreedy;
    return info;
  }
  info.mode = request_is_filtered(p, r) ? kRowFiltered : kRowRandom;
  info.inv_t = inverse_temperature(t);
  info.top_k = p.top_k != nullptr ? p.top_k[r] : 0;
  info.top_p = p.top_p != nullptr ? p.top_p[r] : 1.0f;
  return info;
}

}  // namespace
}  // namespace peagle
