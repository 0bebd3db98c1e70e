// CUDA paged_attention (torch-free): split-KV flash-decoding with the GQA group packed into the
// MMA M dimension, for many query rows per request (P-EAGLE: 2K rows per request).
//
// Work decomposition. A CTA owns (request r, KV head g, query tile, KV split); the 1-D grid runs
// KV heads fastest (the CTAs of one request's KV heads read the same pages at the same time),
// then splits, then requests:
//   * Query tile: the request's (query row, head-in-group) pairs are packed row-major,
//     p = i * G + hh (G = Hq / Hkv), and cut into tiles of kBlockM = 64 or 128 packed rows. A
//     P-EAGLE decode request (14 rows) with G = 8 is one 128-row tile, with G = 4 one 64-row
//     tile, so all rows and heads of a KV head share ONE pass over its pages. Longer requests
//     (prefill) loop over tiles; the launch hint max_query_len only sizes the grid.
//   * KV split: the tile's visible key range [lo_min, hi_max] is cut into kBlockN-key tiles; the
//     number of splits is decided ON THE DEVICE per (request, tile) from seq_lens (split_count),
//     capped by a host bound computed from B, Hkv, the query-tile count and the SM count only.
//     num_splits > 0 fixes it instead. A tile with a single split writes the output directly.
//     Several splits are merged by writing fp32 partials (o, lse) to a workspace that a merge
//     kernel (programmatic dependent launch) combines (the default), or, opt-in with
//     PEAGLE_ATTN_MERGE=cluster on sm_90+, inside this kernel (PagedAttentionPlan::cluster > 1:
//     the splits run as thread-block clusters that merge through distributed shared memory,
//     clusters of one tile through per-slice arrival counters; see cluster_merge_tile).
// Per CTA: Q tile -> registers (ldmatrix), K/V tiles streamed through a kStages-deep cp.async
// ring (each page read once per KV head; the block ids of the next tile are fetched one
// iteration ahead; keys outside [lo_min, hi_max], past the table's capacity or behind an invalid
// block id are zero-filled and never read), S = Q K^T and O += P V on tensor cores, online
// softmax in fp32 in the exp2 domain (one FFMA + ex2 per score; O is rescaled only when a row
// maximum of the warp changed).
// Two tensor-core paths share everything else (same register layouts, same shared-memory tiles):
//   * mma.sync m16n8k16 + ldmatrix (portable: sm_90a and sm_100a);
//   * wgmma m64nNk16 with A (Q, P) in registers and K/V read by the tensor cores from the
//     128-byte-swizzled shared-memory tiles (sm_90a; one warpgroup per 64 packed rows).
// PagedAttentionPlan::impl picks one from the device and the GQA group only (never from the
// max_query_len hint), so a fixed num_splits stays bit-reproducible (under automatic splits the
// query tile rows also depend on the batch and the block table's width); PEAGLE_ATTN_IMPL
// overrides both (see choose_impl). No host sync; the grid depends only on host-known sizes, so the
// launches are CUDA-graph capturable.
#include <cooperative_groups.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cstdlib>
#include <cstring>

#include "launch.cuh"
#include "paged_attention_device.cuh"
#include "paged_attention_heuristics.h"
#include "paged_attention_wgmma.cuh"
#include "peagle/kernels/paged_attention.h"

namespace peagle {
namespace {

using namespace attn;  // NOLINT(build/namespaces): the kernel's own building blocks

constexpr int kMergeWarps = 4;    // merge kernel: one warp per (row, head)
constexpr int kMergeUnroll = 16;  // merge kernel: partial outputs in flight per lane
constexpr int kImplMma = 0;       // PagedAttentionPlan::impl values
constexpr int kImplWgmma = 1;
constexpr int kInertCtas = 8;  // CTAs that write the rows outside every request
constexpr int64_t kGridLimit = kPagedAttentionGridLimit;

// ---------------------------------------------------------------------------------------------
// Kernel configuration
// ---------------------------------------------------------------------------------------------

template <int D, int kBlockM, bool kWgmma, int kBlockN>
struct AttnCfg {
  // Warps and m16 tiles per warp. wgmma: one warpgroup per 64 rows, each warp one m16 slice.
  // mma.sync: one m16 tile per warp, except head_dim 64 with 128-row tiles, where 4 warps x 2
  // m16 tiles reuse every K/V fragment loaded from shared memory twice.
  static constexpr int kWarps =
      kWgmma ? kBlockM / 16 : ((D == 64 && kBlockM == 128) ? 4 : kBlockM / 16);
  static constexpr int kMT = kBlockM / (16 * kWarps);
  static constexpr int kThreads = kWarps * 32;
  // 2 CTAs per SM (112 KB of shared memory each) except 128 rows x head_dim 128 (1 CTA, 224 KB).
  static constexpr int kMinBlocks = (kBlockM == 128 && D == 128) ? 1 : 2;
  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static constexpr int kQBytes = kBlockM * D * 2;
  static constexpr int kKvTileBytes = kBlockN * D * 2;
  static constexpr int kStageBytes = 2 * kKvTileBytes;  // K tile, then V tile
  static constexpr int kSmemBudget = (kMinBlocks == 2 ? 112 : 224) * 1024;
  static constexpr int kStagesFit = (kSmemBudget - kQBytes) / kStageBytes;
  static constexpr int kStages = kStagesFit < 6 ? kStagesFit : 6;  // cp.async ring depth
  // wgmma software pipeline: tile i's P V is issued with tile i + 1's Q K^T and runs during its
  // softmax, so a V stage stays live one tile longer and the ring runs kStages - 2 tiles ahead
  // instead of kStages - 1 -- only where the ring is deep enough for that (>= 4 stages).
  static constexpr bool kPipe = kWgmma && kStages >= 4;
  static constexpr int kAhead = kStages - 1 - (kPipe ? 1 : 0);  // K/V tiles in flight
  // kPipe: Q K^T reads Q from shared memory (a descriptor), which frees the registers the
  // pipeline's second accumulator set needs.
  static constexpr bool kQSmem = kPipe;
  static constexpr int kSmemBytes = kQBytes + kStages * kStageBytes;
  static constexpr int kRowsPerPass = kThreads / kChunks;  // K/V rows copied per pass
  static constexpr int kKvPasses = kBlockN / kRowsPerPass;
  static constexpr int kQPasses = kBlockM * kChunks / kThreads;
  static_assert(D == 64 || D == 128, "head_dim must be 64 or 128");
  // Step addressing (head_dim 64): kStepDescriptors forms the wgmma descriptors as the tile's
  // masked start plus a per-step constant (and the Q base warp-uniform), kByteStrides the K/V
  // addresses as byte-stride multiply-adds (and the block-table row once). Together they issue
  // fewer instructions per KV tile and measured 0.90-0.92x the time of the summed forms for
  // 64/8 x 64 at B = 8 / 64, but 1.06-1.20x for 32/8 x 128 (H200, 2026-12-06;
  // docs/architecture.md), so head_dim 128 keeps the summed forms (masked address sums,
  // element-stride products). Which of the two slows head_dim 128 is not yet measured.
  static constexpr bool kStepDescriptors = D == 64;
  static constexpr bool kByteStrides = D == 64;
  static_assert(kBlockN == 32 || kBlockN == 64, "");
  static_assert(kMT * 16 * kWarps == kBlockM, "");
  static_assert(!kWgmma || (kMT == 1 && kBlockM % 64 == 0), "one warpgroup per 64 rows");
  static_assert(kStages >= 3, "");
  // A thread's K/V rows step by a multiple of 8, so its swizzle phase (row & 7) is fixed.
  static_assert(kRowsPerPass % 8 == 0 && kBlockN % kRowsPerPass == 0, "");
  static_assert((kBlockM * kChunks) % kThreads == 0, "");
  // wgmma tiles must stay 1024-byte aligned (the kernel checks the base).
  static_assert(kQBytes % 1024 == 0 && kKvTileBytes % 1024 == 0, "");
};

// Grid decomposition and softmax constants, shared by the main and the merge kernel.
struct AttnGrid {
  int32_t group;          // Hq / Hkv
  int32_t heads_tiles;    // Hkv * q_tile_ctas (fastest grid index)
  int32_t work_ctas;      // B * heads_tiles * max_splits; the inert-row CTAs follow
  int32_t q_tile_ctas;    // CTAs along the packed-row axis per (request, KV head)
  int32_t max_splits;     // CTAs along the KV axis per (request, KV head, query tile)
  int32_t cluster;        // cluster merge: CTAs per cluster along the KV axis (1: merge kernel)
  int32_t cluster_count;  // cluster merge: clusters per (request, KV head, query tile)
  int32_t block_m;        // packed rows per query tile
  int32_t block_n;        // keys per KV tile
  float scale_log2;       // |softmax_scale| * log2(e), at least FLT_MIN (so -inf * scale = -inf)
  uint32_t q_sign;        // 0x80008000 when softmax_scale < 0: Q's sign is flipped instead
  // The cache's block / slot strides in bytes (the bind checks the element strides lie in
  // [0, 2^31), so these fit 32 bits) and block_size - 1: kernel-parameter values that the K/V
  // address multiply-adds read straight from the constant bank.
  uint32_t k_block_bytes, k_slot_bytes, v_block_bytes, v_slot_bytes;
  uint32_t slot_mask;
};

// Writes 0 (lse -inf) into rows outside every request: [0, qsl[0]) and [qsl[B], T).
template <typename T>
__device__ void write_inert_rows(const PagedAttentionParams& p, int32_t cta, int32_t num_ctas) {
  const int64_t lo = p.num_reqs > 0 ? clamp_val<int64_t>(p.query_start_loc[0], 0, p.num_tokens) : 0;
  const int64_t hi =
      p.num_reqs > 0 ? clamp_val<int64_t>(p.query_start_loc[p.num_reqs], lo, p.num_tokens) : 0;
  const int64_t n_rows = lo + (p.num_tokens - hi);
  T* out = static_cast<T*>(p.out);
  const int32_t per_row = p.num_q_heads * p.head_dim;
  for (int64_t j = cta; j < n_rows; j += num_ctas) {
    const int64_t t = j < lo ? j : hi + (j - lo);
    for (int32_t x = threadIdx.x; x < per_row; x += blockDim.x) {
      const int32_t h = x / p.head_dim, d = x - h * p.head_dim;
      out[t * p.o_stride_t + h * p.o_stride_h + d] = MmaOp<T>::zero();
    }
    if (p.lse) {
      for (int32_t h = threadIdx.x; h < p.num_q_heads; h += blockDim.x) {
        p.lse[t * p.lse_stride_t + h] = kNegInf;
      }
    }
  }
}

// S[64 x kBlockN] = Q K^T and O[64 x D] += P V for one warpgroup (sm_90a).
template <typename T, int kBlockN>
__device__ __forceinline__ void wgmma_qk(float (&s)[kBlockN / 8][4], const uint32_t (&a)[4],
                                         uint64_t desc, int accumulate) {
  if constexpr (kBlockN == 64) {
    wgmma_m64n64k16<T, 0>(s, a, desc, accumulate);
  } else {
    wgmma_m64n32k16<T, 0>(s, a, desc, accumulate);
  }
}
template <typename T, int kBlockN>
__device__ __forceinline__ void wgmma_qk_ss(float (&s)[kBlockN / 8][4], uint64_t desc_a,
                                            uint64_t desc_b, int accumulate) {
  if constexpr (kBlockN == 64) {
    wgmma_m64n64k16_ss<T>(s, desc_a, desc_b, accumulate);
  } else {
    wgmma_m64n32k16_ss<T>(s, desc_a, desc_b, accumulate);
  }
}
template <typename T, int D>
__device__ __forceinline__ void wgmma_pv(float (&o)[D / 8][4], const uint32_t (&a)[4],
                                         uint64_t desc) {
  if constexpr (D == 64) {
    wgmma_m64n64k16<T, 1>(o, a, desc, 1);
  } else {
    wgmma_m64n128k16<T, 1>(o, a, desc, 1);
  }
}

// ---------------------------------------------------------------------------------------------
// Cluster split merge (sm_90+; PagedAttentionPlan::cluster > 1)
// ---------------------------------------------------------------------------------------------
//
// The splits of a query tile run as clusters of C = grid.cluster CTAs, split = c * C + rank;
// clusters with c * C >= n_split skip the tile and the CTAs of an active cluster whose split is
// empty contribute an empty partial (lse -inf, o 0). Level 1: every CTA writes its normalised
// fp32 partial (o / l and lse = m + log2 l: the merge kernel's inputs) into its own shared
// memory; after a cluster barrier, rank j merges the packed rows [j R, (j + 1) R) of the tile
// (R = kBlockM / C) over the C partials, read through distributed shared memory in rank order.
// With one active cluster (n_split <= C) rank j writes those rows' out / lse (sinks applied).
// With nc > 1 active clusters (level 2) rank j writes its cluster's partial of the slice into
// workspace slot c and arrives at the slice's counter (ws_counters at the slice's first (row,
// head), unique per slice); the CTA that draws ticket nc - 1 resets the counter to 0 (the op
// stays graph-replayable with no memset) and merges slots 0 .. nc - 1 in slot order. The
// summation order never depends on the arrival order, so results are bit-reproducible.
// Ordering: writers' stores -> barrier -> thread 0: __threadfence, atomicAdd (release); the
// last arriver: atomicAdd -> barrier -> __threadfence, ld.global.cg reads (acquire).
constexpr int kMaxCluster = 8;

template <int D, int kBlockM>
constexpr int cluster_part_bytes() {
  return kBlockM * (D + 4) * 4 + kBlockM * 4;  // fp32 rows (16-byte padded) + lse
}

template <typename T, int D, int kBlockM, int kMT, int kThreads>
__device__ __forceinline__ void cluster_merge_tile(
    const PagedAttentionParams& p, const AttnGrid& grid, uint8_t* smem,
    const float (&o)[kMT][D / 8][4], const float (&row_m)[kMT][2], const float (&row_l)[kMT][2],
    const AttnRequest& a, int32_t p0, int32_t p1, int32_t g, int32_t n_split) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // clusters need sm_90; the host never selects this path there
#else
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  constexpr int kPS = D + 4;  // fp32 row stride of a partial (rows stay 16-byte aligned)
  constexpr int kV = D / 4;   // float4 per row
  float* part = reinterpret_cast<float*>(smem);
  float* part_lse = part + kBlockM * kPS;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int32_t group = grid.group;
  using Mma = MmaOp<T>;

  __syncthreads();  // every warp is done with Q's and the last K/V stage's shared memory
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float l = row_l[mt][half];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = l != 0.f ? 1.f / l : 0.f;  // NaN l (a NaN score) propagates
      const int row = (warp * kMT + mt) * 16 + (lane >> 2) + half * 8;
      float* dst = part + row * kPS + ((lane & 3) << 1);
#pragma unroll
      for (int cc = 0; cc < D / 8; ++cc) {
        *reinterpret_cast<float2*>(dst + cc * 8) =
            make_float2(o[mt][cc][2 * half] * inv, o[mt][cc][2 * half + 1] * inv);
      }
      if ((lane & 3) == 0) part_lse[row] = l != 0.f ? row_m[mt][half] + __log2f(l) : kNegInf;
    }
  }
  cluster.sync();  // (release / acquire) every rank's partial is visible to the cluster

  const int C = grid.cluster;
  // Recomputed from blockIdx (the main loop keeps fewer registers live).
  const int32_t rank = static_cast<int32_t>(blockIdx.x) % C;
  const int32_t c = static_cast<int32_t>(blockIdx.x) / C / grid.heads_tiles % grid.cluster_count;
  const int R = kBlockM / C;
  const int32_t rows = p1 - p0;
  const int r0 = rank * R;
  const int32_t nc = (n_split + C - 1) / C;  // active clusters of this tile
  const bool final_here = nc == 1;
  // Thread -> n consecutive float4 of one row of the slice (R * D / 4 = n * kThreads exactly):
  // the row's C (or nc) lse values are loaded once, then all of the thread's row loads are in
  // flight together (two dependent round trips per level).
  constexpr int kMaxN = (kBlockM * D) / (8 * kThreads);  // n at C = 2
  static_assert(kMaxN >= 1 && (kBlockM * D) % (8 * kThreads) == 0, "");
  const int n = (R * kV) / kThreads;
  const int row = r0 + tid * n / kV, v0 = tid * n % kV;
  const bool row_ok = row < rows;
  const int32_t pp = p0 + row;
  const int64_t t = a.q_start + pp / group;
  const int32_t h = g * group + pp % group;
  T* const dst = static_cast<T*>(p.out) + t * p.o_stride_t + h * p.o_stride_h + v0 * 4;
  // Writes the output row part (the merge kernel's arithmetic): acc / l, lse (natural log).
  auto write_out = [&](const float (&acc)[kMaxN][4], float l, float m_ref, bool empty) {
    const float inv = empty ? 0.f : 1.f / l;
#pragma unroll
    for (int j = 0; j < kMaxN; ++j) {
      if (j < n) {
        // 4-byte stores: out rows are only 4-byte aligned (the bind's rule).
        *reinterpret_cast<uint32_t*>(dst + j * 4) = Mma::pack(acc[j][0] * inv, acc[j][1] * inv);
        *reinterpret_cast<uint32_t*>(dst + j * 4 + 2) = Mma::pack(acc[j][2] * inv, acc[j][3] * inv);
      }
    }
    if (v0 == 0 && p.lse != nullptr) {
      p.lse[t * p.lse_stride_t + h] =
          empty ? (p.sinks != nullptr ? p.sinks[h] : kNegInf) : (m_ref + __log2f(l)) * kLn2;
    }
  };

  if (row_ok) {
    // Rank s's partial, through distributed shared memory (mapa: recomputed, not kept live).
    auto remote = [&](int s) {
      return static_cast<const float*>(cluster.map_shared_rank(part, s));
    };
    float ls[kMaxCluster];
    float mx = kNegInf;
#pragma unroll
    for (int s = 0; s < kMaxCluster; ++s) {
      ls[s] = s < C ? remote(s)[kBlockM * kPS + row] : kNegInf;
      mx = max_nan(mx, ls[s]);  // a NaN partial makes the row NaN
    }
    const bool sink = final_here && p.sinks != nullptr;
    const float m_ref = sink && mx != kNegInf ? fmaxf(mx, p.sinks[h] * kLog2e) : mx;
    float acc[kMaxN][4] = {};
    float l = 0.f;
    if (mx != kNegInf) {
#pragma unroll
      for (int s = 0; s < kMaxCluster; ++s) {
        if (s < C) {
          const float w = fast_exp2(ls[s] - m_ref);  // 0 for an empty partial
          const float* src = remote(s) + row * kPS + v0 * 4;
          l += w;
#pragma unroll
          for (int j = 0; j < kMaxN; ++j) {
            if (j < n) {
              const float4 x = *reinterpret_cast<const float4*>(src + j * 4);
              acc[j][0] = fmaf(w, x.x, acc[j][0]);
              acc[j][1] = fmaf(w, x.y, acc[j][1]);
              acc[j][2] = fmaf(w, x.z, acc[j][2]);
              acc[j][3] = fmaf(w, x.w, acc[j][3]);
            }
          }
        }
      }
    }
    if (final_here) {
      if (sink && mx != kNegInf) l += fast_exp2(p.sinks[h] * kLog2e - m_ref);
      write_out(acc, l, m_ref, mx == kNegInf);
    } else {  // this cluster's partial of the row: workspace slot c
      const int64_t slot = (static_cast<int64_t>(c) * p.num_tokens + t) * p.num_q_heads + h;
      const float inv = l != 0.f ? 1.f / l : 0.f;
      float* wdst = p.ws_out + slot * D + v0 * 4;
#pragma unroll
      for (int j = 0; j < kMaxN; ++j) {
        if (j < n) {
          *reinterpret_cast<float4*>(wdst + j * 4) =
              make_float4(acc[j][0] * inv, acc[j][1] * inv, acc[j][2] * inv, acc[j][3] * inv);
        }
      }
      if (v0 == 0) p.ws_lse[slot] = l != 0.f ? m_ref + __log2f(l) : kNegInf;
    }
  }
  cluster.sync();  // no rank reads this CTA's shared memory any more (it may be reused or exit)
  if (final_here || r0 >= rows) return;  // CTA-uniform

  // Level 2: the last of the nc clusters to arrive at this slice merges their partials.
  const int32_t pk = p0 + r0;
  const int64_t key = (a.q_start + pk / group) * p.num_q_heads + g * group + pk % group;
  bool last = false;
  if (tid == 0) {
    __threadfence();  // the slice's partial (every thread's stores, ordered by the barrier above)
    const uint32_t ticket = atomicAdd(p.ws_counters + key, 1u);
    last = ticket == static_cast<uint32_t>(nc - 1);
    if (last) atomicExch(p.ws_counters + key, 0u);  // zero again: the next launch starts clean
  }
  if (!__syncthreads_or(last)) return;
  __threadfence();  // acquire: every other cluster's partial of this slice
  if (!row_ok) return;
  const int64_t stride = p.num_tokens * p.num_q_heads;
  const int64_t pair = t * p.num_q_heads + h;
  float mx = kNegInf;
#pragma unroll 4
  for (int32_t cc = 0; cc < nc; ++cc) mx = max_nan(mx, __ldcg(p.ws_lse + cc * stride + pair));
  const float m_ref = p.sinks != nullptr && mx != kNegInf ? fmaxf(mx, p.sinks[h] * kLog2e) : mx;
  float acc[kMaxN][4] = {};
  float l = 0.f;
  if (mx != kNegInf) {
#pragma unroll 2
    for (int32_t cc = 0; cc < nc; ++cc) {
      const float w = fast_exp2(__ldcg(p.ws_lse + cc * stride + pair) - m_ref);
      const float4* src = reinterpret_cast<const float4*>(p.ws_out + (cc * stride + pair) * D) + v0;
      l += w;
#pragma unroll
      for (int j = 0; j < kMaxN; ++j) {
        if (j < n) {
          const float4 x = __ldcg(src + j);
          acc[j][0] = fmaf(w, x.x, acc[j][0]);
          acc[j][1] = fmaf(w, x.y, acc[j][1]);
          acc[j][2] = fmaf(w, x.z, acc[j][2]);
          acc[j][3] = fmaf(w, x.w, acc[j][3]);
        }
      }
    }
    if (p.sinks != nullptr) l += fast_exp2(p.sinks[h] * kLog2e - m_ref);
  }
  write_out(acc, l, m_ref, mx == kNegInf);
#endif
}

// ---------------------------------------------------------------------------------------------
// Main kernel
// ---------------------------------------------------------------------------------------------

// grid = work_ctas (= B * heads_tiles * max_splits: (request, split, KV head x query-tile CTA),
// KV heads fastest) + inert_ctas that write the rows outside every request (usually none, so
// they exit at once; last, so that they take the SM slots the work leaves free).
// Before the PDL wait: an L2 prefetch of the block-table entries split `split` of request r
// reads if the request fills its table (its KV length is known only after the wait). A prefetch
// changes no value, so it is safe before the previous kernel's writes are visible, and a wrong
// guess costs a few idle L2 lines. The lookups after the wait then hit L2: the table is the
// second of three dependent round trips (lengths, table, K/V) before the first tile.
__device__ __forceinline__ void prefetch_table_share(const PagedAttentionParams& p,
                                                     const AttnGrid& grid, int32_t r,
                                                     int32_t split) {
  constexpr int32_t kEntriesPerLine = 32;  // int32 entries per 128-byte line
  const int32_t cap = key_capacity_i32(p);
  const int32_t ntk = (cap + grid.block_n - 1) / grid.block_n;
  const int32_t n_split = split_count(ntk, grid.max_splits, p.num_splits);
  if (split >= n_split) return;
  const int32_t per = (ntk + n_split - 1) / n_split;
  const int32_t key0 = split * per * grid.block_n;
  const int32_t key1 = min(cap, (split + 1) * per * grid.block_n);  // exclusive
  if (key0 >= key1) return;
  const int32_t e0 = key0 >> p.log2_block_size, e1 = ((key1 - 1) >> p.log2_block_size) + 1;
  const int32_t* row = p.block_table + static_cast<int64_t>(r) * p.block_table_stride;
  for (int32_t e = e0 + static_cast<int32_t>(threadIdx.x) * kEntriesPerLine; e < e1;
       e += static_cast<int32_t>(blockDim.x) * kEntriesPerLine) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(row + e));
  }
}

template <typename T, int D, int kBlockM, bool kWgmma, int kBlockN, bool kCluster>
__global__ void __launch_bounds__(AttnCfg<D, kBlockM, kWgmma, kBlockN>::kThreads,
                                  AttnCfg<D, kBlockM, kWgmma, kBlockN>::kMinBlocks)
    paged_attention_kernel(const PagedAttentionParams p, const AttnGrid grid) {
  using Cfg = AttnCfg<D, kBlockM, kWgmma, kBlockN>;
  using Mma = MmaOp<T>;
  constexpr int kChunks = Cfg::kChunks;
  constexpr int kMT = Cfg::kMT;
  constexpr int kStages = Cfg::kStages;
  constexpr int kPasses = Cfg::kKvPasses;
  constexpr int kRowsPerPass = Cfg::kRowsPerPass;
  extern __shared__ __align__(1024) uint8_t smem[];

  if constexpr (!kCluster) {
    const int32_t c = static_cast<int32_t>(blockIdx.x);  // the CTA's coordinates, as below
    const int32_t rest = c / grid.heads_tiles;
    if (c < grid.work_ctas && rest / grid.max_splits < p.num_reqs) {
      prefetch_table_share(p, grid, rest / grid.max_splits, rest % grid.max_splits);
    }
  }
  // Inputs may come from the previous kernel in the stream (PDL launch): wait before any read;
  // then let the merge kernel get scheduled (it waits for this grid's completion itself).
  griddep_wait();
  griddep_launch_dependents();

  const int32_t cta = static_cast<int32_t>(blockIdx.x);
  if (cta >= grid.work_ctas) {
    write_inert_rows<T>(p, cta - grid.work_ctas, static_cast<int32_t>(gridDim.x) - grid.work_ctas);
    return;
  }
  static_assert(!kCluster || cluster_part_bytes<D, kBlockM>() <= Cfg::kSmemBytes, "");
  int32_t ht, split, r, rank = 0;
  if constexpr (kCluster) {
    // (request, cluster, KV head x query-tile CTA, rank): a cluster's CTAs are consecutive (its
    // rank is blockIdx.x % C) and hold consecutive splits; KV heads stay next to each other.
    rank = cta % grid.cluster;
    const int32_t rest0 = cta / grid.cluster;
    ht = rest0 % grid.heads_tiles;
    const int32_t rest = rest0 / grid.heads_tiles;
    r = rest / grid.cluster_count;
    split = rest % grid.cluster_count * grid.cluster + rank;
  } else {
    ht = cta % grid.heads_tiles;
    const int32_t rest = cta / grid.heads_tiles;
    split = rest % grid.max_splits;
    r = rest / grid.max_splits;
  }
  const int32_t g = ht % p.num_kv_heads;
  const int32_t q_cta = ht / p.num_kv_heads;
  const int32_t group = grid.group;
  const AttnRequest a = attn_request(p.query_start_loc, p.seq_lens, p.num_tokens, r);
  if (a.q_len == 0) return;  // padding request: no rows, no table reads

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t s_q = smem_addr(smem);
  if constexpr (kWgmma) {
    if ((s_q & 1023u) != 0) __trap();  // the 128-byte swizzle needs 1024-byte aligned tiles
  }
  const uint32_t s_kv = s_q + Cfg::kQBytes;  // stage s: K at + s * kStageBytes, V after it
  // kQSmem: this warpgroup's 64 rows of the Q tile (64 rows x 128 B per panel). With step
  // descriptors the shuffle makes the warpgroup index visibly warp-uniform, so ptxas keeps the Q
  // descriptors in uniform registers (as CUTLASS's canonical_warp_group_idx).
  uint32_t s_q_wg = s_q + (warp >> 2) * 8192;
  if constexpr (Cfg::kStepDescriptors)
    s_q_wg = s_q + __shfl_sync(0xffffffffu, warp >> 2, 0) * 8192u;
  const T* q_base = static_cast<const T*>(p.query);
  // K/V copy assignment: this thread moves 16-byte chunk kv_chunk of rows kv_row0 + j * step.
  // Byte strides: each address is the head's base plus slot and block times their byte strides
  // (AttnGrid), two 32 x 32 + 64-bit multiply-adds; else element offsets from 32 x 32 -> 64-bit
  // products of the strides (they fit in int32, checked by the bind).
  static_assert(sizeof(T) == 2, "AttnGrid's K/V byte strides assume 2-byte elements");
  const int kv_chunk = tid % kChunks, kv_row0 = tid / kChunks;
  const uint32_t kv_dst0 = tile_offset<kBlockN>(kv_row0, kv_chunk);
  const T* k_base = static_cast<const T*>(p.key_cache) + g * p.k_stride_head + kv_chunk * 8;
  const T* v_base = static_cast<const T*>(p.value_cache) + g * p.v_stride_head + kv_chunk * 8;
  const int32_t k_stride_block = static_cast<int32_t>(p.k_stride_block);
  const int32_t k_stride_slot = static_cast<int32_t>(p.k_stride_slot);
  const int32_t v_stride_block = static_cast<int32_t>(p.v_stride_block);
  const int32_t v_stride_slot = static_cast<int32_t>(p.v_stride_slot);
  const char* k_base_bytes = reinterpret_cast<const char*>(k_base);
  const char* v_base_bytes = reinterpret_cast<const char*>(v_base);
  const uint32_t num_blocks =
      static_cast<uint32_t>(p.num_blocks < INT32_MAX ? p.num_blocks : INT32_MAX);
  // The request's block-table row, formed once: with byte strides the empty asm makes it
  // opaque, so ptxas keeps it in two registers rather than redoing the 64 x 64-bit row product
  // before every lookup.
  const int32_t* table = p.block_table + static_cast<int64_t>(r) * p.block_table_stride;
  if constexpr (Cfg::kByteStrides) asm("" : "+l"(table));
  const int32_t cap = key_capacity_i32(p);
  const float sl = grid.scale_log2;
  const int32_t packed_total = a.q_len * group;
  const int32_t n_qtiles = (packed_total + kBlockM - 1) / kBlockM;

  // Every shared-memory row this thread addresses in an ldmatrix has row & 7 == lane & 7.
  const int sw = lane & 7;
  const int k_row = ((lane >> 4) << 3) + (lane & 7), k_chunk_hi = (lane >> 3) & 1;
  const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3), v_chunk_hi = lane >> 4;

  for (int32_t q_iter = q_cta; q_iter < n_qtiles; q_iter += grid.q_tile_ctas) {
    // Heaviest tile first: later rows see more keys under the causal mask (prefill), and the
    // CTAs with the lowest indices are scheduled first.
    const int32_t qt = n_qtiles - 1 - q_iter;
    const int32_t p0 = qt * kBlockM;
    const int32_t p1 = min(p0 + kBlockM, packed_total);
    const TileKeys tk = tile_keys(a, p0, p1, group, p.window_left, cap, kBlockN);
    const int32_t n_split = split_count(tk.ntk, grid.max_splits, p.num_splits);
    if constexpr (kCluster) {
      // Cluster-uniform: a cluster holding no split skips the tile (one split: split 0 alone,
      // written directly). An empty split of an active cluster takes part with no keys.
      if (n_split == 1 ? split > 0 : split - rank >= n_split) continue;
    } else if (split >= n_split) {
      continue;  // uniform across the CTA
    }
    const int32_t per_split = (tk.ntk + n_split - 1) / n_split;
    const int32_t kt_begin = tk.kt0 + split * per_split;
    const int32_t n_tiles = max(0, min(tk.kt0 + tk.ntk, kt_begin + per_split) - kt_begin);

    // Block ids of this thread's K/V rows of tile kt (-1: invisible key or !valid; only columns
    // of keys in [lo_min, hi_max] of this split are read).
    auto fetch_blocks = [&](int32_t kt, bool valid, int32_t (&blk)[kPasses]) {
#pragma unroll
      for (int j = 0; j < kPasses; ++j) {
        const int32_t key = kt * kBlockN + kv_row0 + j * kRowsPerPass;
        const bool in_range = valid && key >= tk.lo_min && key <= tk.hi_max;
        if constexpr (Cfg::kByteStrides) {
          // key >= lo_min >= 0 where it is read: an unsigned column index (one IMAD.WIDE.U32).
          blk[j] = in_range ? __ldg(table + static_cast<uint32_t>(key >> p.log2_block_size)) : -1;
        } else {
          blk[j] = in_range ? __ldg(table + (key >> p.log2_block_size)) : -1;
        }
      }
    };
    // K/V tile kt -> ring stage `stage`.
    auto issue_kv = [&](int32_t kt, const int32_t (&blk)[kPasses], int stage) {
      const uint32_t s_k = s_kv + stage * Cfg::kStageBytes + kv_dst0;
#pragma unroll
      for (int j = 0; j < kPasses; ++j) {
        const int32_t key = kt * kBlockN + kv_row0 + j * kRowsPerPass;
        const bool ok = static_cast<uint32_t>(blk[j]) < num_blocks;  // also rejects blk < 0
        if constexpr (Cfg::kByteStrides) {
          // !ok: nothing is read (src-size 0); block 0 keeps the address near the cache.
          const uint32_t b = ok ? static_cast<uint32_t>(blk[j]) : 0u;
          const uint32_t slot = static_cast<uint32_t>(key) & grid.slot_mask;
          const char* k_src = mad_wide_u32(b, grid.k_block_bytes,
                                           mad_wide_u32(slot, grid.k_slot_bytes, k_base_bytes));
          const char* v_src = mad_wide_u32(b, grid.v_block_bytes,
                                           mad_wide_u32(slot, grid.v_slot_bytes, v_base_bytes));
          const uint32_t dst = s_k + j * kRowsPerPass * 128;  // rows are 128 B apart in a panel
          cp_async_16(dst, k_src, ok);
          cp_async_16(dst + Cfg::kKvTileBytes, v_src, ok);
        } else {
          const int32_t slot = key & (p.block_size - 1);
          // 32 x 32 -> 64-bit products; offset 0 (nothing is read) when !ok.
          const int64_t koff =
              ok ? mul_wide(blk[j], k_stride_block) + mul_wide(slot, k_stride_slot) : 0;
          const int64_t voff =
              ok ? mul_wide(blk[j], v_stride_block) + mul_wide(slot, v_stride_slot) : 0;
          const uint32_t dst = s_k + j * kRowsPerPass * 128;
          cp_async_16(dst, k_base + koff, ok);
          cp_async_16(dst + Cfg::kKvTileBytes, v_base + voff, ok);
        }
      }
    };

    __syncthreads();  // the previous query tile is done with shared memory

    // Warp w owns m16 tiles w*kMT .. w*kMT + kMT - 1 of the packed tile; this thread owns rows
    // lane/4 and lane/4 + 8 of each (its accumulator rows). Per row: visible key bounds for the
    // mask; rows past the tile are masked everywhere and never written.
    int32_t row_lo[kMT][2], row_hi[kMT][2];
    bool mt_active[kMT];  // warp-uniform: m16 tiles with no valid row skip their work
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      const int32_t m0 = p0 + (warp * kMT + mt) * 16;
      mt_active[mt] = m0 < p1;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int32_t pp = m0 + (lane >> 2) + half * 8;
        const int32_t i = pp / group;
        row_hi[mt][half] = pp < p1 ? min(a.kv_len - a.q_len + i, cap - 1) : -1;
        row_lo[mt][half] =
            static_cast<int32_t>(attn_row_key_lo(a.kv_len, a.q_len, i, p.window_left));
      }
    }
    const bool warp_active = mt_active[0];  // tiles fill in order: warp idle iff its first is

    float o[kMT][D / 8][4];
    float row_m[kMT][2], row_l[kMT][2];  // row_m: running max of the scaled (log2) scores
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int c = 0; c < D / 8; ++c) o[mt][c][0] = o[mt][c][1] = o[mt][c][2] = o[mt][c][3] = 0.f;
      row_m[mt][0] = row_m[mt][1] = kNegInf;
      row_l[mt][0] = row_l[mt][1] = 0.f;
    }

    if (n_tiles > 0) {  // CTA-uniform; a tile that sees no key only writes zeros
      // Block ids of the first kStages tiles (all loads in flight together), then Q and the
      // first kStages - 1 K/V tiles; nblk carries the ids of the next tile to issue.
      int32_t nblk[kPasses];
      {
        constexpr int kAhead = Cfg::kAhead;
        int32_t blk[kAhead + 1][kPasses];
#pragma unroll
        for (int st = 0; st <= kAhead; ++st) fetch_blocks(kt_begin + st, st < n_tiles, blk[st]);
        // Q tile -> shared memory (rows past the tile are zero).
#pragma unroll
        for (int it = 0; it < Cfg::kQPasses; ++it) {
          const int c = tid + it * Cfg::kThreads;
          const int m = c / kChunks, ch = c % kChunks;
          const int32_t pp = p0 + m;
          const bool ok = pp < p1;
          const T* src = q_base;
          if (ok) {
            const int64_t t = a.q_start + pp / group;
            const int32_t h = g * group + pp % group;
            src = q_base + t * p.q_stride_t + h * p.q_stride_h + ch * 8;
          }
          cp_async_16(s_q + tile_offset<kBlockM>(m, ch), src, ok);
        }
#pragma unroll
        for (int st = 0; st < kAhead; ++st) {
          if (st < n_tiles) issue_kv(kt_begin + st, blk[st], st);
          cp_async_commit();  // group 0 also carries Q
        }
#pragma unroll
        for (int j = 0; j < kPasses; ++j) nblk[j] = blk[kAhead][j];
      }

      cp_async_wait<Cfg::kAhead - 1>();  // Q (and the first K/V tile) landed
      __syncthreads();
      if constexpr (Cfg::kQSmem) {
        if (grid.q_sign != 0) {  // negative scale: flip Q's signs in place (rare)
          for (int w = tid; w < Cfg::kQBytes / 4; w += Cfg::kThreads) {
            reinterpret_cast<uint32_t*>(smem)[w] ^= grid.q_sign;
          }
          fence_proxy_async_smem();  // -> wgmma's async proxy (the loop's barrier follows)
        }
      }
      uint32_t qa[Cfg::kQSmem ? 1 : kMT][Cfg::kQSmem ? 1 : D / 16][4];
#pragma unroll
      for (int mt = 0; mt < (Cfg::kQSmem ? 0 : kMT); ++mt) {
        if (!kWgmma && !mt_active[mt]) continue;  // wgmma: every warp feeds its (zero) rows
        const int q_row = (warp * kMT + mt) * 16 + (lane & 15);
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          ldmatrix_x4(s_q + tile_offset<kBlockM>(q_row, kk * 2 + (lane >> 4)), qa[mt][kk]);
#pragma unroll
          for (int e = 0; e < 4; ++e) qa[mt][kk][e] ^= grid.q_sign;  // negative scale
        }
      }

      float s[kMT][kBlockN / 8][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j)
          s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
      }
      // kPipe: the previous tile's P (packed) and V stage, consumed by the next wgmma batch.
      // Before the first tile they are 0 and a zeroed V tile (that of the last stage, first
      // refilled at tile 1), so every tile issues the same wgmma batches: a P V issued only
      // from tile 1 on (a divergent path) makes ptxas serialize every wgmma of the kernel.
      uint32_t pa_prev[Cfg::kPipe ? kBlockN / 16 : 1][4];
      uint32_t sv_prev = 0;
      if constexpr (Cfg::kPipe) {
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk)
          pa_prev[kk][0] = pa_prev[kk][1] = pa_prev[kk][2] = pa_prev[kk][3] = 0u;
        sv_prev = s_kv + (kStages - 1) * Cfg::kStageBytes + Cfg::kKvTileBytes;
        for (int c = tid; c < Cfg::kKvTileBytes / 16; c += Cfg::kThreads) {
          st_shared_zero16(sv_prev + c * 16);
        }
        fence_proxy_async_smem();  // the zeros -> wgmma's async proxy (the loop's barrier follows)
      }
      int read_stage = 0, write_stage = Cfg::kAhead;
      for (int32_t it = 0; it < n_tiles; ++it) {
        cp_async_wait<Cfg::kAhead - 1>();
        if constexpr (kWgmma) fence_proxy_async_smem();  // landed K/V -> wgmma's async proxy
        // Tile `it` visible to all; the stage of tile it - 1 (kPipe: it - 2) is free again.
        __syncthreads();
        {
          const int32_t nt = it + Cfg::kAhead;
          if (nt < n_tiles) issue_kv(kt_begin + nt, nblk, write_stage);
          cp_async_commit();
          fetch_blocks(kt_begin + nt + 1, nt + 1 < n_tiles, nblk);  // lands during this tile
          write_stage = write_stage + 1 == kStages ? 0 : write_stage + 1;
        }
        // Scratch for the rare bad-key gather: Q's tile (dead: Q is in registers), or with kQSmem
        // the previous tile's K (consumed, and not refilled before the next tile).
        const uint32_t s_scratch =
            Cfg::kQSmem ? s_kv + (read_stage == 0 ? kStages - 1 : read_stage - 1) * Cfg::kStageBytes
                        : s_q;
        const uint32_t sk = s_kv + read_stage * Cfg::kStageBytes;
        const uint32_t sv = sk + Cfg::kKvTileBytes;
        read_stage = read_stage + 1 == kStages ? 0 : read_stage + 1;
        const int32_t key0 = (kt_begin + it) * kBlockN;
        // A tile crossing a row's causal or window edge holds keys that some of its rows must
        // not see. Their probabilities are exactly 0 in those rows, but 0 * inf/NaN = NaN in
        // P V, so such keys' non-finite V values are replaced by 0 (SPEC 5: masked keys never
        // affect a row). The rows that do see a replaced value get NaN accumulators instead, as
        // IEEE arithmetic (the CPU kernel) gives them. Keys every row sees need nothing.
        if (key0 < tk.max_lo || key0 + kBlockN - 1 > tk.min_hi) {  // CTA-uniform
          uint64_t my_bad = 0;  // bit (key - key0): this thread scrubbed a word of that key
          constexpr int kWords = D / 2;  // 32-bit words per key row
          // Only the partly masked keys' rows are visited: [0, n_lo) lie before the last row's
          // first key (window), [r_hi, kBlockN) after the first row's last key (causal); the
          // keys in between every row sees. r_hi >= n_lo, so no row is visited twice.
          const int n_lo = min(max(tk.max_lo - key0, 0), kBlockN);
          const int r_hi = min(max(tk.min_hi - key0 + 1, n_lo), kBlockN);
          const int n_words = (n_lo + kBlockN - r_hi) * kWords;
#pragma unroll 1
          for (int w = tid; w < n_words; w += Cfg::kThreads) {
            const int i = w / kWords;
            const int row = i < n_lo ? i : r_hi + (i - n_lo);
            const int wc = w % kWords;
            auto* word = reinterpret_cast<uint32_t*>(smem + (sv - s_q) +
                                                     tile_offset<kBlockN>(row, wc >> 2)) +
                         (wc & 3);
            const uint32_t v = *word, clean = scrub_pair<T>(v);
            if (clean != v) {
              *word = clean;
              my_bad |= uint64_t{1} << row;
            }
          }
          if constexpr (kWgmma) {
            if (my_bad != 0) fence_proxy_async_smem();  // scrubbed V -> wgmma's async proxy
          }
          if (__syncthreads_or(my_bad != 0)) {  // rare: gather the keys, poison the rows
            auto* bad_keys = reinterpret_cast<unsigned long long*>(smem + (s_scratch - s_q));
            if (tid == 0) *bad_keys = 0;
            __syncthreads();
            if (my_bad != 0) atomicOr(bad_keys, static_cast<unsigned long long>(my_bad));
            __syncthreads();
            const uint64_t bad = *bad_keys;
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
              for (int half = 0; half < 2; ++half) {
                if (key_bits(key0, row_lo[mt][half], row_hi[mt][half]) & bad) {
#pragma unroll
                  for (int c = 0; c < D / 8; ++c)
                    o[mt][c][2 * half] = o[mt][c][2 * half + 1] = kNaN;
                }
              }
            }
          }
        }
        if (!kWgmma && !warp_active) continue;

        // S = Q K^T (raw scores); kPipe: O += P V of the previous tile runs behind it, through
        // this tile's softmax (tile 0: 0 x a zeroed V tile, which leaves O as it is).
        if constexpr (kWgmma) {
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk) {
            if constexpr (Cfg::kQSmem) {  // this warpgroup's 64 rows of the Q tile
              wgmma_qk_ss<T, kBlockN>(
                  s[0], k_operand_desc<kBlockM, Cfg::kStepDescriptors>(s_q_wg, kk),
                  k_operand_desc<kBlockN, Cfg::kStepDescriptors>(sk, kk), kk > 0);
            } else {
              wgmma_qk<T, kBlockN>(s[0], qa[0][kk],
                                   k_operand_desc<kBlockN, Cfg::kStepDescriptors>(sk, kk), kk > 0);
            }
          }
          wgmma_commit();
          if constexpr (Cfg::kPipe) {
#pragma unroll
            for (int kk = 0; kk < kBlockN / 16; ++kk) {
              wgmma_pv<T, D>(o[0], pa_prev[kk],
                             v_operand_desc<kBlockN, Cfg::kStepDescriptors>(sv_prev, kk));
            }
            wgmma_commit();
            wgmma_wait<1>();  // S landed; P V may still run
          } else {
            wgmma_wait<0>();
          }
          fence_operands(s[0]);
        } else {
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j)
              s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
          }
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk) {
            const int ch = kk * 2 + k_chunk_hi;
            const uint32_t k_addr =
                sk + (ch >> 3) * (kBlockN * 128) + k_row * 128 + (((ch & 7) ^ sw) << 4);
#pragma unroll
            for (int j = 0; j < kBlockN / 8; j += 2) {
              uint32_t b[4];
              ldmatrix_x4(k_addr + j * 8 * 128, b);
#pragma unroll
              for (int mt = 0; mt < kMT; ++mt) {
                if (!mt_active[mt]) continue;
                Mma::run(s[mt][j], qa[mt][kk], b[0], b[1]);
                Mma::run(s[mt][j + 1], qa[mt][kk], b[2], b[3]);
              }
            }
          }
        }

        // Mask (only tiles crossing a row's causal/window edge).
        if (key0 < tk.max_lo || key0 + kBlockN - 1 > tk.min_hi) {
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int32_t key = key0 + j * 8 + ((lane & 3) << 1) + (e & 1);
                const int half = e >> 1;
                if (key < row_lo[mt][half] || key > row_hi[mt][half]) s[mt][j][e] = kNegInf;
              }
            }
          }
        }

        // Online softmax (fp32, exp2 domain): p = 2^(s * sl - m), running (thread-partial) sum
        // l; O is rescaled only if some row maximum of this warp changed.
        float alpha[kMT][2];
        bool changed = false;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          alpha[mt][0] = alpha[mt][1] = 1.f;
          if (!mt_active[mt]) continue;  // warp-uniform: rows past the tile are never written
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            float mx = kNegInf;
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j) {
              mx = fmaxf(mx, fmaxf(s[mt][j][2 * half], s[mt][j][2 * half + 1]));
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_old = row_m[mt][half];
            const float m_new = fmaxf(m_old, mx * sl);  // sl > 0: -inf stays -inf
            const float m_use = m_new == kNegInf ? 0.f : m_new;
            if (m_new != m_old) {
              alpha[mt][half] = fast_exp2(m_old - m_use);  // 0 when m_old == -inf
              changed = true;
            }
            row_m[mt][half] = m_new;
            float sum0 = 0.f, sum1 = 0.f;  // two chains: half the FADD latency
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j) {
              const int e = 2 * half;
              s[mt][j][e] = fast_exp2(fmaf(s[mt][j][e], sl, -m_use));
              s[mt][j][e + 1] = fast_exp2(fmaf(s[mt][j][e + 1], sl, -m_use));
              sum0 += s[mt][j][e];
              sum1 += s[mt][j][e + 1];
            }
            row_l[mt][half] = row_l[mt][half] * alpha[mt][half] + (sum0 + sum1);
          }
        }
        if constexpr (Cfg::kPipe) {  // the previous tile's P V, before O is rescaled
          wgmma_wait<0>();
          fence_operands(o[0]);
        }
        if (__any_sync(0xffffffffu, changed)) {
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
            for (int c = 0; c < D / 8; ++c) {
#pragma unroll
              for (int e = 0; e < 4; ++e) o[mt][c][e] *= alpha[mt][e >> 1];
            }
          }
        }

        // O += P V: P (bf16/fp16) comes straight from the S accumulators' register layout.
        if constexpr (Cfg::kPipe) {  // issued with the next tile's S (or after the loop)
#pragma unroll
          for (int kk = 0; kk < kBlockN / 16; ++kk) {
            const bool on = mt_active[0];
            pa_prev[kk][0] = on ? Mma::pack(s[0][2 * kk][0], s[0][2 * kk][1]) : 0u;
            pa_prev[kk][1] = on ? Mma::pack(s[0][2 * kk][2], s[0][2 * kk][3]) : 0u;
            pa_prev[kk][2] = on ? Mma::pack(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]) : 0u;
            pa_prev[kk][3] = on ? Mma::pack(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]) : 0u;
          }
          sv_prev = sv;
        } else if constexpr (kWgmma) {
          uint32_t pa[kBlockN / 16][4];
#pragma unroll
          for (int kk = 0; kk < kBlockN / 16; ++kk) {
            const bool on = mt_active[0];
            pa[kk][0] = on ? Mma::pack(s[0][2 * kk][0], s[0][2 * kk][1]) : 0u;
            pa[kk][1] = on ? Mma::pack(s[0][2 * kk][2], s[0][2 * kk][3]) : 0u;
            pa[kk][2] = on ? Mma::pack(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]) : 0u;
            pa[kk][3] = on ? Mma::pack(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]) : 0u;
          }
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kBlockN / 16; ++kk) {
            wgmma_pv<T, D>(o[0], pa[kk], v_operand_desc<kBlockN, Cfg::kStepDescriptors>(sv, kk));
          }
          wgmma_commit();
          wgmma_wait<0>();  // before the next barrier lets this stage be overwritten
          fence_operands(o[0]);
        } else {
#pragma unroll
          for (int kk = 0; kk < kBlockN / 16; ++kk) {
            uint32_t pa[kMT][4];
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
              pa[mt][0] = Mma::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
              pa[mt][1] = Mma::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
              pa[mt][2] = Mma::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
              pa[mt][3] = Mma::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int c = 0; c < D / 8; c += 2) {
              const int ch = c + v_chunk_hi;
              const uint32_t v_addr = sv + (ch >> 3) * (kBlockN * 128) + (v_row + kk * 16) * 128 +
                                      (((ch & 7) ^ sw) << 4);
              uint32_t b[4];
              ldmatrix_x4_trans(v_addr, b);
#pragma unroll
              for (int mt = 0; mt < kMT; ++mt) {
                if (!mt_active[mt]) continue;
                Mma::run(o[mt][c], pa[mt], b[0], b[1]);
                Mma::run(o[mt][c + 1], pa[mt], b[2], b[3]);
              }
            }
          }
        }
      }
      if constexpr (Cfg::kPipe) {  // the last tile's P V
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
          wgmma_pv<T, D>(o[0], pa_prev[kk],
                         v_operand_desc<kBlockN, Cfg::kStepDescriptors>(sv_prev, kk));
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_operands(o[0]);
      }
    }

    // Epilogue: quad-reduce l, then write out/lse (single split) or the fp32 partials.
    if constexpr (kCluster) {
      if (n_split > 1) {
        cluster_merge_tile<T, D, kBlockM, kMT, Cfg::kThreads>(p, grid, smem, o, row_m, row_l, a, p0,
                                                              p1, g, n_split);
        continue;
      }
    }
    if (!warp_active) continue;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float l = row_l[mt][half];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int32_t pp = p0 + (warp * kMT + mt) * 16 + (lane >> 2) + half * 8;
        if (pp >= p1) continue;
        const int64_t t = a.q_start + pp / group;
        const int32_t h = g * group + pp % group;
        const float m = row_m[mt][half];  // log2 domain; -inf iff l == 0
        const int dcol = (lane & 3) << 1;
        // l == 0: the row sees no key. l is NaN when a score it sees is (a NaN key): propagated.
        if (n_split == 1) {
          float o_scale = 0.f, lse = kNegInf;
          if (p.sinks != nullptr) {
            const float sink = p.sinks[h] * kLog2e;
            if (l != 0.f) {
              const float mm = fmaxf(m, sink);
              const float w = fast_exp2(m - mm);
              const float l_tot = l * w + fast_exp2(sink - mm);
              o_scale = w / l_tot;
              lse = (mm + __log2f(l_tot)) * kLn2;
            } else {
              lse = p.sinks[h];
            }
          } else if (l != 0.f) {
            o_scale = 1.f / l;
            lse = (m + __log2f(l)) * kLn2;
          }
          T* dst = static_cast<T*>(p.out) + t * p.o_stride_t + h * p.o_stride_h + dcol;
#pragma unroll
          for (int c = 0; c < D / 8; ++c) {
            *reinterpret_cast<uint32_t*>(dst + c * 8) =
                Mma::pack(o[mt][c][2 * half] * o_scale, o[mt][c][2 * half + 1] * o_scale);
          }
          if (p.lse != nullptr && (lane & 3) == 0) p.lse[t * p.lse_stride_t + h] = lse;
        } else {
          const float inv = l != 0.f ? 1.f / l : 0.f;
          const int64_t row = (static_cast<int64_t>(split) * p.num_tokens + t) * p.num_q_heads + h;
          float* dst = p.ws_out + row * D + dcol;
#pragma unroll
          for (int c = 0; c < D / 8; ++c) {
            *reinterpret_cast<float2*>(dst + c * 8) =
                make_float2(o[mt][c][2 * half] * inv, o[mt][c][2 * half + 1] * inv);
          }
          if ((lane & 3) == 0) p.ws_lse[row] = l != 0.f ? m + __log2f(l) : kNegInf;
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Merge kernel: one warp per (row, head) whose tile was split; fixed summation order.
// ---------------------------------------------------------------------------------------------

// Request owning row t (largest r with qsl[r] <= t, clamped like attn_request), or -1.
__device__ __forceinline__ int32_t find_request(const PagedAttentionParams& p, int64_t t) {
  if (p.num_reqs == 0) return -1;
  int32_t lo = 0, hi = p.num_reqs - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) >> 1;
    if (clamp_val<int64_t>(p.query_start_loc[mid], 0, p.num_tokens) <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const AttnRequest a = attn_request(p.query_start_loc, p.seq_lens, p.num_tokens, lo);
  return (t >= a.q_start && t < a.q_start + a.q_len) ? lo : -1;
}

template <int kPerLane>
struct MergeVec;
template <>
struct MergeVec<2> {
  using type = float2;
  static __device__ __forceinline__ void fma(float (&acc)[2], float w, float2 v) {
    acc[0] = fmaf(w, v.x, acc[0]);
    acc[1] = fmaf(w, v.y, acc[1]);
  }
};
template <>
struct MergeVec<4> {
  using type = float4;
  static __device__ __forceinline__ void fma(float (&acc)[4], float w, float4 v) {
    acc[0] = fmaf(w, v.x, acc[0]);
    acc[1] = fmaf(w, v.y, acc[1]);
    acc[2] = fmaf(w, v.z, acc[2]);
    acc[3] = fmaf(w, v.w, acc[3]);
  }
};

template <typename T, int D>
__global__ void __launch_bounds__(kMergeWarps * 32)
    paged_attention_merge_kernel(const PagedAttentionParams p, const AttnGrid grid) {
  constexpr int kPerLane = D / 32;
  using Vec = MergeVec<kPerLane>;
  using VecT = typename Vec::type;
  const int lane = threadIdx.x & 31;
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * kMergeWarps + (threadIdx.x >> 5);
  const int64_t stride = p.num_tokens * p.num_q_heads;

  // Which rows were split: from launch inputs only (safe before the main kernel completes).
  int32_t n_split = 0;
  int64_t t = 0;
  int32_t h = 0;
  if (pair < stride) {
    t = pair / p.num_q_heads;
    h = static_cast<int32_t>(pair - t * p.num_q_heads);
    const int32_t r = find_request(p, t);
    if (r >= 0) {
      const AttnRequest a = attn_request(p.query_start_loc, p.seq_lens, p.num_tokens, r);
      const int32_t gk = h / grid.group;
      const int32_t pp = static_cast<int32_t>(t - a.q_start) * grid.group + (h - gk * grid.group);
      const int32_t p0 = pp / grid.block_m * grid.block_m;
      const int32_t p1 = min(p0 + grid.block_m, a.q_len * grid.group);
      const TileKeys tk =
          tile_keys(a, p0, p1, grid.group, p.window_left, key_capacity_i32(p), grid.block_n);
      n_split = split_count(tk.ntk, grid.max_splits, p.num_splits);
    }
  }
  griddep_wait();  // the main kernel's partials are complete and visible
  griddep_launch_dependents();
  if (n_split <= 1) return;  // inert, unsplit or out of range: written by the main kernel

  // Max of the split lse values (log2 domain), lanes over splits.
  // NaN-propagating (a split that saw a NaN score has lse NaN: the row's output is NaN).
  float mx = kNegInf;
  for (int32_t s = lane; s < n_split; s += 32) mx = max_nan(mx, p.ws_lse[s * stride + pair]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  T* dst = static_cast<T*>(p.out) + t * p.o_stride_t + h * p.o_stride_h + lane * kPerLane;
  if (mx == kNegInf) {  // the row sees no key: 0, lse = sink (or -inf), as in the main kernel
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) dst[e] = MmaOp<T>::zero();
    if (p.lse != nullptr && lane == 0) {
      p.lse[t * p.lse_stride_t + h] = p.sinks != nullptr ? p.sinks[h] : kNegInf;
    }
    return;
  }
  if (p.sinks != nullptr) mx = fmaxf(mx, p.sinks[h] * kLog2e);

  // Weighted sum: lane s (mod 32) holds split s's weight; every lane owns kPerLane columns and
  // keeps up to kMergeUnroll partial rows in flight.
  float acc[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) acc[e] = 0.f;
  float l = 0.f;  // lane-partial sum of the weights
  const float* src = p.ws_out + pair * D + lane * kPerLane;
  for (int32_t s0 = 0; s0 < n_split; s0 += 32) {
    const int32_t n_here = min(32, n_split - s0);
    const float w_lane =
        lane < n_here ? fast_exp2(p.ws_lse[(s0 + lane) * stride + pair] - mx) : 0.f;
    l += w_lane;
    for (int32_t u0 = 0; u0 < n_here; u0 += kMergeUnroll) {
      VecT v[kMergeUnroll];
#pragma unroll
      for (int u = 0; u < kMergeUnroll; ++u) {
        if (u0 + u < n_here) {
          v[u] = *reinterpret_cast<const VecT*>(src + (s0 + u0 + u) * stride * D);
        }
      }
#pragma unroll
      for (int u = 0; u < kMergeUnroll; ++u) {
        if (u0 + u < n_here) {  // warp-uniform
          Vec::fma(acc, __shfl_sync(0xffffffffu, w_lane, u0 + u), v[u]);
        }
      }
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
  if (p.sinks != nullptr) l += fast_exp2(p.sinks[h] * kLog2e - mx);
  const float inv = 1.f / l;
#pragma unroll
  for (int e = 0; e < kPerLane; e += 2) {
    *reinterpret_cast<uint32_t*>(dst + e) = MmaOp<T>::pack(acc[e] * inv, acc[e + 1] * inv);
  }
  if (p.lse != nullptr && lane == 0) p.lse[t * p.lse_stride_t + h] = (mx + __log2f(l)) * kLn2;
}

// ---------------------------------------------------------------------------------------------
// Host side: configuration, occupancy, launch
// ---------------------------------------------------------------------------------------------

// Opts the instantiation into > 48 KB of dynamic shared memory (per device, so on every launch;
// it is a cheap host call) and reports its resident CTAs per SM (cached per instantiation).
template <typename T, int D, int kBlockM, bool kWgmma, int kBlockN, bool kCluster = false>
cudaError_t prepare_kernel(int* ctas_per_sm) {
  using Cfg = AttnCfg<D, kBlockM, kWgmma, kBlockN>;
  auto kernel = paged_attention_kernel<T, D, kBlockM, kWgmma, kBlockN, kCluster>;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  if (ctas_per_sm != nullptr) {
    static const int occupancy = [&] {
      int n = 0;
      if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, Cfg::kThreads,
                                                        Cfg::kSmemBytes) != cudaSuccess) {
        (void)cudaGetLastError();
        n = 1;
      }
      return n > 0 ? n : 1;
    }();
    *ctas_per_sm = occupancy;
  }
  return cudaSuccess;
}

// Clusters of `cluster` CTAs of the cluster-merge instantiation the device holds at once
// (cudaOccupancyMaxActiveClusters: SMs are grouped, so this can be less than SMs x CTAs per SM /
// cluster), cached per instantiation and cluster size; 0 when the query fails (the plan then
// keeps the merge kernel).
template <typename T, int D, int kBlockM, bool kWgmma, int kBlockN>
int max_active_clusters(int cluster) {
  using Cfg = AttnCfg<D, kBlockM, kWgmma, kBlockN>;
  static std::atomic<int> cached[kMaxCluster + 1];  // n + 1; 0: not asked yet
  if (cluster < 2 || cluster > kMaxCluster) return 0;
  const int c = cached[cluster].load(std::memory_order_relaxed);
  if (c > 0) return c - 1;
  int n = 0;
  if (prepare_kernel<T, D, kBlockM, kWgmma, kBlockN, true>(nullptr) == cudaSuccess) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(cluster) * 64u);
    cfg.blockDim = dim3(Cfg::kThreads);
    cfg.dynamicSmemBytes = Cfg::kSmemBytes;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(cluster);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (cudaOccupancyMaxActiveClusters(&n,
                                       paged_attention_kernel<T, D, kBlockM, kWgmma, kBlockN, true>,
                                       &cfg) != cudaSuccess) {
      n = 0;
    }
  }
  (void)cudaGetLastError();
  n = n > 0 ? n : 0;
  cached[cluster].store(n + 1, std::memory_order_relaxed);
  return n;
}

template <typename T, int D, int kBlockM, bool kWgmma, int kBlockN, bool kCluster>
cudaError_t launch_main(const PagedAttentionParams& p, const AttnGrid& g, int64_t ctas,
                        cudaStream_t stream) {
  using Cfg = AttnCfg<D, kBlockM, kWgmma, kBlockN>;
  const cudaError_t err = prepare_kernel<T, D, kBlockM, kWgmma, kBlockN, kCluster>(nullptr);
  if (err != cudaSuccess) return err;
  auto kernel = paged_attention_kernel<T, D, kBlockM, kWgmma, kBlockN, kCluster>;
  const dim3 blocks(static_cast<unsigned>(ctas));
  if constexpr (kCluster) {
    return launch_cluster_pdl(kernel, blocks, dim3(Cfg::kThreads), Cfg::kSmemBytes, stream,
                              static_cast<unsigned>(g.cluster), p, g);
  } else {
    return launch_pdl(kernel, blocks, dim3(Cfg::kThreads), Cfg::kSmemBytes, stream, p, g);
  }
}

// Calls fn.template run<kBlockM, kWgmma, kBlockN>() for the plan's instantiation. 32-key tiles
// exist for head_dim 128 with 64-row query tiles and for head_dim 64 with 128-row wgmma tiles
// (choose_impl never asks for others).
template <int D, typename Fn>
auto dispatch_tile(const PagedAttentionPlan& plan, const Fn& fn) {
  const bool wg = plan.impl == kImplWgmma;
  if constexpr (D == 128) {
    if (plan.block_n == 32 && plan.block_m == 64) {
      return wg ? fn.template run<64, true, 32>() : fn.template run<64, false, 32>();
    }
  } else {
    if (plan.block_n == 32 && plan.block_m == 128 && wg) return fn.template run<128, true, 32>();
  }
  if (plan.block_m == 64) {
    return wg ? fn.template run<64, true, 64>() : fn.template run<64, false, 64>();
  }
  return wg ? fn.template run<128, true, 64>() : fn.template run<128, false, 64>();
}

template <typename T, int D>
struct OccupancyFn {
  template <int M, bool W, int N>
  int run() const {
    int n = 1;
    prepare_kernel<T, D, M, W, N>(&n);
    return n;
  }
};

template <typename T, int D>
struct ClustersFn {
  int cluster;
  template <int M, bool W, int N>
  int run() const {
    return max_active_clusters<T, D, M, W, N>(cluster);
  }
};

template <typename T, int D>
struct LaunchMainFn {
  const PagedAttentionParams& p;
  const AttnGrid& g;
  int64_t ctas;
  cudaStream_t stream;
  template <int M, bool W, int N>
  cudaError_t run() const {
    return g.cluster > 1 ? launch_main<T, D, M, W, N, true>(p, g, ctas, stream)
                         : launch_main<T, D, M, W, N, false>(p, g, ctas, stream);
  }
};

// Calls fn_for<T, D>(plan) with the element type and head_dim of p (bf16/fp16 x 64/128).
template <template <typename, int> class Fn, typename... A>
int dispatch_typed(const PagedAttentionParams& p, const PagedAttentionPlan& plan, A... args) {
  const bool bf16 = p.dtype == AttnDtype::kBFloat16;
  if (p.head_dim == 64) {
    return bf16 ? dispatch_tile<64>(plan, Fn<__nv_bfloat16, 64>{args...})
                : dispatch_tile<64>(plan, Fn<__half, 64>{args...});
  }
  return bf16 ? dispatch_tile<128>(plan, Fn<__nv_bfloat16, 128>{args...})
              : dispatch_tile<128>(plan, Fn<__half, 128>{args...});
}

AttnGrid make_grid(const PagedAttentionParams& p, const PagedAttentionPlan& plan) {
  AttnGrid g;
  g.group = p.num_q_heads / p.num_kv_heads;
  g.q_tile_ctas = plan.q_tile_ctas;
  g.heads_tiles = p.num_kv_heads * plan.q_tile_ctas;
  g.work_ctas = static_cast<int32_t>(plan.grid_ctas - plan.inert_ctas);
  g.max_splits = plan.max_splits;
  g.cluster = plan.cluster;
  g.cluster_count = plan.cluster_count;
  g.block_m = plan.block_m;
  g.block_n = plan.block_n;
  const float a = p.softmax_scale < 0.f ? -p.softmax_scale : p.softmax_scale;
  g.scale_log2 = fmaxf(a * kLog2e, FLT_MIN);
  g.q_sign = p.softmax_scale < 0.f ? 0x80008000u : 0u;
  constexpr uint32_t kElemBytes = 2;  // bf16 / fp16
  g.k_block_bytes = static_cast<uint32_t>(p.k_stride_block) * kElemBytes;
  g.k_slot_bytes = static_cast<uint32_t>(p.k_stride_slot) * kElemBytes;
  g.v_block_bytes = static_cast<uint32_t>(p.v_stride_block) * kElemBytes;
  g.v_slot_bytes = static_cast<uint32_t>(p.v_stride_slot) * kElemBytes;
  g.slot_mask = static_cast<uint32_t>(p.block_size - 1);
  return g;
}

template <typename T, int D>
cudaError_t launch_typed(const PagedAttentionParams& p, const PagedAttentionPlan& plan,
                         cudaStream_t stream) {
  const AttnGrid g = make_grid(p, plan);
  cudaError_t err = dispatch_tile<D>(plan, LaunchMainFn<T, D>{p, g, plan.grid_ctas, stream});
  if (err != cudaSuccess || plan.cluster > 1 || !plan.needs_workspace) return err;
  const int64_t pairs = p.num_tokens * p.num_q_heads;
  const unsigned blocks = static_cast<unsigned>((pairs + kMergeWarps - 1) / kMergeWarps);
  return launch_pdl(paged_attention_merge_kernel<T, D>, dim3(blocks), dim3(kMergeWarps * 32), 0,
                    stream, p, g);
}

// PEAGLE_ATTN_IMPL (benchmarks/tests): "mma" or "wgmma" forces the tensor-core path ("wgmma"
// only where it exists: sm_90); "m64" / "m128" force the query tile rows, "n32" 32-key KV tiles
// (these three also turn the short-KV tile rule off); unset or "auto": wgmma on sm_90 for GQA
// groups >= 4, else mma.sync; tile_rows(group) rows, 64 for groups > 4 on the wgmma path under
// automatic splits where the block table holds little KV (heuristics::narrow_query_tiles);
// 64-key KV tiles.
// Whether the loaded sm_90 binary has the wgmma kernels: a build for plain sm_90 (not sm_90a)
// compiles them to a trap stub (PEAGLE_ATTN_HAS_WGMMA == 0), which needs a few dozen registers
// where the real kernels hold >= 64 fp32 accumulators per thread.
bool wgmma_compiled() {
  static const bool compiled = [] {
    cudaFuncAttributes attr = {};
    if (cudaFuncGetAttributes(
            &attr, paged_attention_kernel<__nv_bfloat16, 64, 64, true, 64, false>) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return attr.numRegs >= 96;
  }();
  return compiled;
}

void choose_impl(const PagedAttentionParams& p, int64_t group, PagedAttentionPlan& plan) {
  namespace h = paged_attention_heuristics;
  const char* env = std::getenv("PEAGLE_ATTN_IMPL");
  const bool has_wgmma = p.arch == 90 && wgmma_compiled();
  plan.impl = h::use_wgmma(has_wgmma, group) ? kImplWgmma : kImplMma;
  plan.block_m = h::tile_rows(group);
  plan.block_n = 64;
  if (env != nullptr && std::strstr(env, "wgmma") != nullptr) {
    plan.impl = has_wgmma ? kImplWgmma : kImplMma;
  } else if (env != nullptr && std::strstr(env, "mma") != nullptr) {
    plan.impl = kImplMma;
  }
  const bool forced_tile =
      env != nullptr && (std::strstr(env, "m64") != nullptr ||
                         std::strstr(env, "m128") != nullptr || std::strstr(env, "n32") != nullptr);
  if (!forced_tile && plan.impl == kImplWgmma && plan.block_m == 128) {
    const int64_t capacity = static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size;
    if (h::narrow_query_tiles(p.num_reqs, p.num_kv_heads, capacity,
                              p.num_sms > 0 ? p.num_sms : kDefaultSmCount, p.num_splits == 0)) {
      plan.block_m = 64;
    }
  }
  if (!forced_tile && plan.impl == kImplWgmma && plan.block_m == 64 && p.head_dim == 128) {
    const int64_t capacity = static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size;
    if (h::single_cta_splits(p.num_reqs, p.num_kv_heads, capacity,
                             p.num_sms > 0 ? p.num_sms : kDefaultSmCount, p.num_splits == 0)) {
      plan.block_n = 32;
      plan.one_cta_per_sm = true;
    }
  }
  if (env == nullptr) return;
  if (std::strstr(env, "m64") != nullptr) plan.block_m = 64;
  if (std::strstr(env, "m128") != nullptr && group > 4) plan.block_m = 128;
  // 32-key tiles where instantiated: head_dim 128 with 64-row tiles, head_dim 64 with 128-row
  // wgmma tiles.
  const bool has_n32 = (p.head_dim == 128 && plan.block_m == 64) ||
                       (p.head_dim == 64 && plan.block_m == 128 && plan.impl == kImplWgmma);
  if (std::strstr(env, "n32") != nullptr && has_n32) plan.block_n = 32;
}

// PEAGLE_ATTN_MERGE (benchmarks/tests, read at every call, so at graph capture): "cluster" selects
// the in-kernel cluster merge on sm_90+; anything else (the default) the separate merge kernel,
// which measured faster on the H200 at every split shape (docs/results.md, cluster merge).
bool cluster_merge_allowed(const PagedAttentionParams& p) {
  if (p.merge_mode == 1 || p.arch < 90) return false;
  const char* env = std::getenv("PEAGLE_ATTN_MERGE");
  return env != nullptr && std::strstr(env, "cluster") != nullptr;
}

// Cluster merge for a plan with max_splits > 1 (sm_90+): the cluster size and the clusters per
// tile, or cluster = 1 (merge kernel) where the device holds no such cluster.
void choose_cluster(const PagedAttentionParams& p, int64_t base_ctas, PagedAttentionPlan& plan) {
  namespace h = paged_attention_heuristics;
  if (plan.max_splits < 2 || !cluster_merge_allowed(p)) return;
  if (p.num_splits > 0) {  // fixed: exactly num_splits splits, whole clusters of them
    const int32_t c = h::cluster_size(plan.max_splits, kMaxCluster);
    if (dispatch_typed<ClustersFn>(p, plan, c) < 1) return;
    plan.cluster = c;
    plan.cluster_count = (plan.max_splits + c - 1) / c;
    return;
  }
  // Automatic: the cluster size whose resident clusters hold the most splits in one wave.
  int32_t best_c = 1, best_splits = 0;
  for (int32_t c = h::cluster_size(plan.max_splits, kMaxCluster); c >= 2; c /= 2) {
    const int active = dispatch_typed<ClustersFn>(p, plan, c);
    const int32_t s = h::cluster_splits(active, c, base_ctas, plan.max_splits);
    if (s > best_splits) {
      best_c = c;
      best_splits = s;
    }
  }
  if (best_c < 2 || best_splits < 2) return;
  plan.cluster = best_c;
  plan.cluster_count = best_splits / best_c;
  plan.max_splits = best_splits;
}

}  // namespace

PagedAttentionPlan plan_paged_attention(const PagedAttentionParams& p) {
  namespace h = paged_attention_heuristics;
  PagedAttentionPlan plan;
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  choose_impl(p, group, plan);
  // The 1-D grid inert_ctas + B * Hkv * q_tile_ctas * max_splits must stay below 2^31 (the bind
  // checks B * Hkv * num_splits <= kGridLimit).
  const int64_t reqs_heads =
      std::max<int64_t>(1, static_cast<int64_t>(p.num_reqs) * p.num_kv_heads);
  const int64_t fixed_splits = p.num_splits > 0 ? p.num_splits : 1;
  plan.q_tile_ctas = h::query_tile_ctas(group, p.max_query_len, plan.block_m, reqs_heads,
                                        fixed_splits, kGridLimit);
  const int64_t base = static_cast<int64_t>(p.num_reqs) * p.num_kv_heads * plan.q_tile_ctas;
  if (p.num_splits > 0) {
    plan.max_splits = p.num_splits;
  } else {
    const int per_sm = plan.one_cta_per_sm ? 1 : dispatch_typed<OccupancyFn>(p, plan);
    plan.max_splits = h::auto_splits(p.num_sms > 0 ? p.num_sms : kDefaultSmCount, per_sm, base,
                                     kGridLimit / (reqs_heads * plan.q_tile_ctas), kMaxAutoSplits);
  }
  const int32_t kernel_splits = plan.max_splits;
  choose_cluster(p, base, plan);
  const int64_t inert = h::inert_ctas(p.num_tokens, kInertCtas);
  if (plan.cluster > 1 &&
      base * plan.cluster * plan.cluster_count + inert + plan.cluster > kGridLimit) {
    plan.cluster = plan.cluster_count = 1;  // (not at real sizes) a grid too large: merge kernel
    plan.max_splits = kernel_splits;
  }
  // CTAs along the KV axis per tile: max_splits, or whole clusters.
  const int64_t split_ctas =
      plan.cluster > 1 ? static_cast<int64_t>(plan.cluster) * plan.cluster_count : plan.max_splits;
  const int64_t c = plan.cluster;
  plan.ws_partials = plan.cluster > 1 ? (plan.cluster_count > 1 ? plan.cluster_count : 0)
                                      : (plan.max_splits > 1 ? plan.max_splits : 0);
  plan.needs_workspace = plan.ws_partials > 0;
  plan.needs_counters = plan.cluster > 1 && plan.cluster_count > 1;
  // Inert-row CTAs form whole clusters of their own (they never touch a cluster barrier).
  plan.inert_ctas = static_cast<int32_t>((inert + c - 1) / c * c);
  plan.grid_ctas = plan.inert_ctas + base * split_ctas;
  return plan;
}

cudaError_t launch_paged_attention(const PagedAttentionParams& p, const PagedAttentionPlan& plan,
                                   cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (plan.needs_workspace && (p.ws_out == nullptr || p.ws_lse == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (plan.needs_counters && p.ws_counters == nullptr) return cudaErrorInvalidValue;
  if (plan.grid_ctas < 1 || plan.grid_ctas > INT32_MAX) return cudaErrorInvalidConfiguration;
  const bool bf16 = p.dtype == AttnDtype::kBFloat16;
  if (p.dtype == AttnDtype::kFloat32) return cudaErrorInvalidValue;
  if (p.head_dim == 64) {
    return bf16 ? launch_typed<__nv_bfloat16, 64>(p, plan, stream)
                : launch_typed<__half, 64>(p, plan, stream);
  }
  if (p.head_dim == 128) {
    return bf16 ? launch_typed<__nv_bfloat16, 128>(p, plan, stream)
                : launch_typed<__half, 128>(p, plan, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace peagle
