// CUDA paged_attention (torch-free): split-KV flash-decoding with the GQA group packed into the
// MMA M dimension, for many query rows per request (P-EAGLE: 2K rows per request).
//
// Work decomposition. A CTA owns (request r, KV head g, query tile, KV split):
//   * Query tile: the request's (query row, head-in-group) pairs are packed row-major,
//     p = i * G + hh (G = Hq / Hkv), and cut into tiles of kBlockM = 64 or 128 packed rows, one
//     m16 slice per warp. A P-EAGLE decode request (14 rows) with G = 8 is one 128-row tile, with
//     G = 4 one 64-row tile, so all rows and heads of a KV head share ONE pass over its pages.
//     Longer requests (prefill) loop over tiles; the launch hint max_query_len only sizes the grid.
//   * KV split: the tile's visible key range [lo_min, hi_max] is cut into 64-key tiles; the number
//     of splits is decided ON THE DEVICE per (request, tile) from seq_lens (split_count), capped by
//     a host bound computed from B, Hkv, the query-tile count and the SM count only. num_splits > 0
//     fixes it instead. Splits write fp32 partial (o, lse) to a workspace and a merge kernel
//     (launched with programmatic dependent launch where available) combines them; a tile with a
//     single split writes the output directly.
// Per CTA: Q tile -> registers (ldmatrix), K/V 64-key tiles streamed through a kStages-deep
// cp.async ring (each page read once per KV head; keys outside [lo_min, hi_max], past the table's
// capacity or behind an invalid block id are zero-filled and never read), S = Q K^T and O += P V
// with mma.sync m16n8k16 (bf16/fp16 in, fp32 accumulate), online softmax in fp32 (exp2 domain).
// Runs on sm_90a and sm_100a (mma.sync, ldmatrix, cp.async exist on both). No host sync; the grid
// depends only on host-known sizes, so the launches are CUDA-graph capturable.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <limits>

#include "peagle/kernels/paged_attention.h"

namespace peagle {
namespace {

constexpr int kBlockN = 64;           // keys per KV tile
constexpr int kStages = 3;            // cp.async ring depth (K and V tiles per stage)
constexpr int kMinTilesPerSplit = 2;  // automatic splits keep at least this many KV tiles
constexpr int kMaxAutoSplits = 64;    // automatic split cap
constexpr int kMergeWarps = 4;        // merge kernel: one warp per (row, head)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------------
// PTX helpers
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; zero-fills (reads nothing) when !pred.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool pred) {
  const int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
struct MmaOp;

template <>
struct MmaOp<__nv_bfloat16> {
  // d += a (16x16, row) * b (16x8, col); bf16 inputs, fp32 accumulators.
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ __nv_bfloat16 zero() { return __float2bfloat16(0.f); }
};

template <>
struct MmaOp<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ __half zero() { return __float2half(0.f); }
};

// ---------------------------------------------------------------------------------------------
// Shared between the main and the merge kernel: tile key range and split count
// ---------------------------------------------------------------------------------------------

struct TileKeys {
  int32_t lo_min;  // first key any row of the tile sees
  int32_t hi_max;  // last key any row of the tile sees (capacity-clamped)
  int32_t kt0;     // first 64-key tile
  int32_t ntk;     // 64-key tiles in [lo_min, hi_max] (0: the tile sees nothing)
  int32_t min_hi;  // last key the tile's FIRST row sees (tiles past it need the causal mask)
  int32_t max_lo;  // first key the tile's LAST row sees (tiles before it need the window mask)
};

__device__ __forceinline__ int32_t key_capacity_i32(const PagedAttentionParams& p) {
  const int64_t cap = attn_key_capacity(p);
  return cap > INT32_MAX ? INT32_MAX : static_cast<int32_t>(cap);
}

// Rows of packed tile [p0, p1) are i = p0 / G .. (p1 - 1) / G of request `a`.
__device__ __forceinline__ TileKeys tile_keys(const AttnRequest& a, int32_t p0, int32_t p1,
                                              int32_t group, int32_t window_left, int32_t cap) {
  TileKeys k;
  const int32_t i_first = p0 / group, i_last = (p1 - 1) / group;
  const int32_t hi_last = a.kv_len - a.q_len + i_last;  // <= kv_len - 1
  const int32_t hi_first = a.kv_len - a.q_len + i_first;
  k.hi_max = min(hi_last, cap - 1);
  k.min_hi = min(hi_first, cap - 1);
  k.lo_min = static_cast<int32_t>(attn_row_key_lo(a.kv_len, a.q_len, i_first, window_left));
  k.max_lo = static_cast<int32_t>(attn_row_key_lo(a.kv_len, a.q_len, i_last, window_left));
  if (k.hi_max < k.lo_min) {
    k.kt0 = 0;
    k.ntk = 0;
  } else {
    k.kt0 = k.lo_min / kBlockN;
    k.ntk = k.hi_max / kBlockN - k.kt0 + 1;
  }
  return k;
}

// Splits of a tile with `ntk` KV tiles: fixed (num_splits > 0) or automatic (at most max_splits,
// at least kMinTilesPerSplit tiles each), then shrunk so that no split is empty.
__device__ __forceinline__ int32_t split_count(int32_t ntk, int32_t max_splits, int32_t fixed) {
  if (ntk <= 1) return 1;
  int32_t s =
      fixed > 0 ? fixed : min(max_splits, (ntk + kMinTilesPerSplit - 1) / kMinTilesPerSplit);
  s = max(1, min(s, ntk));
  const int32_t per = (ntk + s - 1) / s;
  return (ntk + per - 1) / per;
}

// ---------------------------------------------------------------------------------------------
// Main kernel
// ---------------------------------------------------------------------------------------------

template <int D, int kBlockM>
struct AttnCfg {
  // Warps and m16 tiles per warp: one m16 tile per warp, except head_dim 64 with 128-row tiles,
  // where 4 warps x 2 m16 tiles reuse every K/V fragment loaded from shared memory twice (8
  // warps x 1 would read each K/V tile from shared memory 8 times: as many bytes/clk as HBM).
  static constexpr int kWarps = (D == 64 && kBlockM == 128) ? 4 : kBlockM / 16;
  static constexpr int kMT = kBlockM / (16 * kWarps);
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static constexpr int kRowBytes = D * 2;
  static constexpr int kQBytes = kBlockM * kRowBytes;
  static constexpr int kKvTileBytes = kBlockN * kRowBytes;
  static constexpr int kSmemBytes = kQBytes + 2 * kStages * kKvTileBytes;
  // 2 CTAs per SM where shared memory allows it (register cap 255 at 128 threads).
  static constexpr int kMinBlocks = (kBlockM == 128 && D == 128) ? 1 : 2;
  static_assert(D % 64 == 0, "head_dim must be a multiple of 64");
  static_assert(kMT * 16 * kWarps == kBlockM, "");
  static_assert((kBlockN * kChunks) % kThreads == 0 && (kBlockM * kChunks) % kThreads == 0, "");
  // K/V copies step by a multiple of 8 rows, so a thread's swizzle phase (row & 7) is fixed.
  static_assert((kThreads / kChunks) % 8 == 0, "");
};

// Byte offset of 16-byte chunk `chunk` of row `row` in a [rows, D] bf16/fp16 tile; XOR swizzle so
// that the 8 row addresses of an ldmatrix phase and cp.async stores hit distinct banks.
template <int D>
__device__ __forceinline__ uint32_t swizzle(int row, int chunk) {
  return static_cast<uint32_t>(row * (D * 2) + ((chunk ^ (row & 7)) << 4));
}

// Writes 0 (lse -inf) into rows outside every request: [0, qsl[0]) and [qsl[B], T).
template <typename T>
__device__ void write_inert_rows(const PagedAttentionParams& p, int cta, int num_ctas) {
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

// grid = (B + 1, Hkv * q_tile_ctas, max_splits); block x == B writes the inert rows.
template <typename T, int D, int kBlockM>
__global__ void __launch_bounds__(AttnCfg<D, kBlockM>::kThreads, AttnCfg<D, kBlockM>::kMinBlocks)
    paged_attention_kernel(const PagedAttentionParams p, int32_t group, int32_t q_tile_ctas,
                           int32_t max_splits) {
  using Cfg = AttnCfg<D, kBlockM>;
  using Mma = MmaOp<T>;
  constexpr int kChunks = Cfg::kChunks;
  constexpr int kMT = Cfg::kMT;
  extern __shared__ __align__(128) uint8_t smem[];

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Let the merge kernel (programmatic dependent launch) get scheduled once every CTA of this
  // grid runs; it still waits for this grid's completion before reading anything.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif

  const int r = blockIdx.x;
  if (r == p.num_reqs) {
    if (blockIdx.z == 0) write_inert_rows<T>(p, blockIdx.y, gridDim.y);
    return;
  }
  const int g = blockIdx.y % p.num_kv_heads;
  const int q_cta = blockIdx.y / p.num_kv_heads;
  const int split = blockIdx.z;
  const AttnRequest a = attn_request(p.query_start_loc, p.seq_lens, p.num_tokens, r);
  if (a.q_len == 0) return;  // padding request: no rows, no table reads

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t s_q = smem_addr(smem);
  const uint32_t s_k = s_q + Cfg::kQBytes;
  const uint32_t s_v = s_k + kStages * Cfg::kKvTileBytes;
  const T* q_base = static_cast<const T*>(p.query);
  // K/V copy assignment: this thread moves 16-byte chunk kv_chunk of rows kv_row0 + j * step.
  // Cache strides fit in int32 (checked by the bind); block offsets are formed in 64 bits.
  const int kv_chunk = tid % kChunks, kv_row0 = tid / kChunks;
  const uint32_t kv_dst0 = swizzle<D>(kv_row0, kv_chunk);  // step is a multiple of 8 rows
  const T* k_base = static_cast<const T*>(p.key_cache) + g * p.k_stride_head + kv_chunk * 8;
  const T* v_base = static_cast<const T*>(p.value_cache) + g * p.v_stride_head + kv_chunk * 8;
  const int32_t k_stride_block = static_cast<int32_t>(p.k_stride_block);
  const int32_t k_stride_slot = static_cast<int32_t>(p.k_stride_slot);
  const int32_t v_stride_block = static_cast<int32_t>(p.v_stride_block);
  const int32_t v_stride_slot = static_cast<int32_t>(p.v_stride_slot);
  const uint32_t num_blocks =
      static_cast<uint32_t>(p.num_blocks < INT32_MAX ? p.num_blocks : INT32_MAX);
  const int32_t* table = p.block_table + static_cast<int64_t>(r) * p.block_table_stride;
  const int32_t cap = key_capacity_i32(p);
  const float scale_log2 = p.softmax_scale * kLog2e;
  const int32_t packed_total = a.q_len * group;
  const int32_t n_qtiles = (packed_total + kBlockM - 1) / kBlockM;

  for (int32_t q_iter = q_cta; q_iter < n_qtiles; q_iter += q_tile_ctas) {
    // Heaviest tile first: later rows see more keys under the causal mask (prefill), and the
    // CTAs with the lowest indices are scheduled first.
    const int32_t qt = n_qtiles - 1 - q_iter;
    const int32_t p0 = qt * kBlockM;
    const int32_t p1 = min(p0 + kBlockM, packed_total);
    const TileKeys tk = tile_keys(a, p0, p1, group, p.window_left, cap);
    const int32_t n_split = split_count(tk.ntk, max_splits, p.num_splits);
    if (split >= n_split) continue;  // uniform across the CTA
    const int32_t per_split = (tk.ntk + n_split - 1) / n_split;
    const int32_t kt_begin = tk.kt0 + split * per_split;
    const int32_t n_tiles = max(0, min(tk.kt0 + tk.ntk, kt_begin + per_split) - kt_begin);

    __syncthreads();  // the previous query tile is done with shared memory

    // Q tile -> shared memory (rows past the tile are zero).
#pragma unroll
    for (int it = 0; it < kBlockM * kChunks / Cfg::kThreads; ++it) {
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
      cp_async_16(s_q + swizzle<D>(m, ch), src, ok);
    }
    cp_async_commit();

    // K/V tile kt -> stage `stage`. Each thread copies fixed chunk `ch` of rows row0 + j*step.
    auto load_kv = [&](int32_t kt, int stage) {
      constexpr int kRowsPerPass = Cfg::kThreads / kChunks;
      const int32_t key0 = kt * kBlockN + kv_row0;
#pragma unroll
      for (int j = 0; j < kBlockN / kRowsPerPass; ++j) {
        const int32_t key = key0 + j * kRowsPerPass;
        const bool in_range = key >= tk.lo_min && key <= tk.hi_max;
        const int32_t blk = in_range ? __ldg(table + (key >> p.log2_block_size)) : -1;
        const bool ok = static_cast<uint32_t>(blk) < num_blocks;  // also rejects blk < 0
        const int32_t slot = key & (p.block_size - 1);
        const int64_t koff = ok ? static_cast<int64_t>(blk) * k_stride_block +
                                      static_cast<int64_t>(slot) * k_stride_slot
                                : 0;
        const int64_t voff = ok ? static_cast<int64_t>(blk) * v_stride_block +
                                      static_cast<int64_t>(slot) * v_stride_slot
                                : 0;
        const uint32_t dst =
            stage * Cfg::kKvTileBytes + kv_dst0 + j * kRowsPerPass * Cfg::kRowBytes;
        cp_async_16(s_k + dst, k_base + koff, ok);
        cp_async_16(s_v + dst, v_base + voff, ok);
      }
    };

#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if (st < n_tiles) load_kv(kt_begin + st, st);
      cp_async_commit();
    }

    // Warp w owns m16 tiles w*kMT .. w*kMT + kMT - 1 of the packed tile; this thread owns rows
    // lane/4 and lane/4 + 8 of each (its accumulator rows). Per row: visible key bounds for the
    // mask; rows past the tile are masked everywhere and never written.
    int32_t row_lo[kMT][2], row_hi[kMT][2];
    bool mt_active[kMT];  // warp-uniform: m16 tiles with no valid row skip their MMAs
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
    float row_m[kMT][2], row_l[kMT][2];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int c = 0; c < D / 8; ++c) o[mt][c][0] = o[mt][c][1] = o[mt][c][2] = o[mt][c][3] = 0.f;
      row_m[mt][0] = row_m[mt][1] = kNegInf;
      row_l[mt][0] = row_l[mt][1] = 0.f;
    }
    uint32_t qa[kMT][D / 16][4];

    cp_async_wait<kStages - 2>();  // Q (and the first K/V tile) landed
    __syncthreads();
    // Every shared-memory row this thread addresses in an ldmatrix has row & 7 == lane & 7, so the
    // swizzled address is a per-thread row offset plus ((chunk ^ sw) << 4).
    const int sw = lane & 7;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      if (!mt_active[mt]) continue;
      const uint32_t q_row = s_q + ((warp * kMT + mt) * 16 + (lane & 15)) * Cfg::kRowBytes;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        ldmatrix_x4(q_row + (((kk * 2 + (lane >> 4)) ^ sw) << 4), qa[mt][kk]);
      }
    }
    const uint32_t k_row = (((lane >> 4) << 3) + (lane & 7)) * Cfg::kRowBytes;
    const uint32_t v_row = ((lane & 7) + (((lane >> 3) & 1) << 3)) * Cfg::kRowBytes;
    const int k_chunk_hi = (lane >> 3) & 1, v_chunk_hi = lane >> 4;

    for (int32_t it = 0; it < n_tiles; ++it) {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // tile `it` visible to all; stage (it - 1) % kStages free again
      {
        const int32_t nt = it + kStages - 1;
        if (nt < n_tiles) load_kv(kt_begin + nt, nt % kStages);
        cp_async_commit();
      }
      if (!warp_active) continue;
      const int stage = it % kStages;
      const uint32_t sk = s_k + stage * Cfg::kKvTileBytes;
      const uint32_t sv = s_v + stage * Cfg::kKvTileBytes;
      const int32_t key0 = (kt_begin + it) * kBlockN;

      // S = Q K^T for this warp's kMT x 16 rows x 64 keys; each K fragment serves every m16 tile.
      float s[kMT][kBlockN / 8][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j)
          s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
      }
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int j = 0; j < kBlockN / 8; j += 2) {
          uint32_t b[4];
          ldmatrix_x4(sk + k_row + j * 8 * Cfg::kRowBytes + (((kk * 2 + k_chunk_hi) ^ sw) << 4), b);
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            if (!mt_active[mt]) continue;
            Mma::run(s[mt][j], qa[mt][kk], b[0], b[1]);
            Mma::run(s[mt][j + 1], qa[mt][kk], b[2], b[3]);
          }
        }
      }

      // Scale into the exp2 domain, then mask (only tiles crossing a row's causal/window edge).
      const bool need_mask = key0 < tk.max_lo || key0 + kBlockN - 1 > tk.min_hi;
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][j][e] *= scale_log2;
        }
      }
      if (need_mask) {
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

      // Online softmax (fp32): running max m, running (thread-partial) sum l, rescaled O.
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float mx = kNegInf;
#pragma unroll
          for (int j = 0; j < kBlockN / 8; ++j) {
            mx = fmaxf(mx, fmaxf(s[mt][j][2 * half], s[mt][j][2 * half + 1]));
          }
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(row_m[mt][half], mx);
          const float m_use = m_new == kNegInf ? 0.f : m_new;
          const float alpha = fast_exp2(row_m[mt][half] - m_use);
          row_m[mt][half] = m_new;
          float sum = 0.f;
#pragma unroll
          for (int j = 0; j < kBlockN / 8; ++j) {
            s[mt][j][2 * half] = fast_exp2(s[mt][j][2 * half] - m_use);
            s[mt][j][2 * half + 1] = fast_exp2(s[mt][j][2 * half + 1] - m_use);
            sum += s[mt][j][2 * half] + s[mt][j][2 * half + 1];
          }
          row_l[mt][half] = row_l[mt][half] * alpha + sum;
#pragma unroll
          for (int c = 0; c < D / 8; ++c) {
            o[mt][c][2 * half] *= alpha;
            o[mt][c][2 * half + 1] *= alpha;
          }
        }
      }

      // O += P V: P (bf16/fp16) comes straight from the S accumulators' register layout; each V
      // fragment serves every m16 tile.
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
          uint32_t b[4];
          ldmatrix_x4_trans(sv + v_row + kk * 16 * Cfg::kRowBytes + (((c + v_chunk_hi) ^ sw) << 4),
                            b);
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            if (!mt_active[mt]) continue;
            Mma::run(o[mt][c], pa[mt], b[0], b[1]);
            Mma::run(o[mt][c + 1], pa[mt], b[2], b[3]);
          }
        }
      }
    }

    // Epilogue: quad-reduce l, then write out/lse (single split) or the fp32 partials.
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
        if (n_split == 1) {
          float o_scale = 0.f, lse = kNegInf;
          if (p.sinks != nullptr) {
            const float sink = p.sinks[h] * kLog2e;
            if (l > 0.f) {
              const float mm = fmaxf(m, sink);
              const float w = fast_exp2(m - mm);
              const float l_tot = l * w + fast_exp2(sink - mm);
              o_scale = w / l_tot;
              lse = (mm + __log2f(l_tot)) * kLn2;
            } else {
              lse = p.sinks[h];
            }
          } else if (l > 0.f) {
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
          const float inv = l > 0.f ? 1.f / l : 0.f;
          const int64_t row = (static_cast<int64_t>(split) * p.num_tokens + t) * p.num_q_heads + h;
          float* dst = p.ws_out + row * D + dcol;
#pragma unroll
          for (int c = 0; c < D / 8; ++c) {
            *reinterpret_cast<float2*>(dst + c * 8) =
                make_float2(o[mt][c][2 * half] * inv, o[mt][c][2 * half + 1] * inv);
          }
          if ((lane & 3) == 0) p.ws_lse[row] = l > 0.f ? m + __log2f(l) : kNegInf;
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

template <typename T, int D>
__global__ void __launch_bounds__(kMergeWarps * 32)
    paged_attention_merge_kernel(const PagedAttentionParams p, int32_t group, int32_t block_m,
                                 int32_t max_splits) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the main kernel's writes are visible
#endif
  constexpr int kPerLane = D / 32;
  const int lane = threadIdx.x & 31;
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * kMergeWarps + (threadIdx.x >> 5);
  if (pair >= p.num_tokens * p.num_q_heads) return;
  const int64_t t = pair / p.num_q_heads;
  const int32_t h = static_cast<int32_t>(pair - t * p.num_q_heads);
  const int32_t r = find_request(p, t);
  if (r < 0) return;  // inert row: written by the main kernel
  const AttnRequest a = attn_request(p.query_start_loc, p.seq_lens, p.num_tokens, r);
  const int32_t g = h / group;
  const int32_t pp = static_cast<int32_t>(t - a.q_start) * group + (h - g * group);
  const int32_t p0 = pp / block_m * block_m;
  const int32_t p1 = min(p0 + block_m, a.q_len * group);
  const TileKeys tk = tile_keys(a, p0, p1, group, p.window_left, key_capacity_i32(p));
  const int32_t n_split = split_count(tk.ntk, max_splits, p.num_splits);
  if (n_split <= 1) return;  // written directly by the main kernel

  const int64_t stride = p.num_tokens * p.num_q_heads;
  float mx = kNegInf;
  for (int32_t s = 0; s < n_split; ++s) mx = fmaxf(mx, p.ws_lse[s * stride + pair]);
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
  float acc[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) acc[e] = 0.f;
  float l = p.sinks != nullptr ? fast_exp2(p.sinks[h] * kLog2e - mx) : 0.f;
  for (int32_t s = 0; s < n_split; ++s) {
    const float w = fast_exp2(p.ws_lse[s * stride + pair] - mx);
    l += w;
    const float* src = p.ws_out + (s * stride + pair) * D + lane * kPerLane;
    if constexpr (kPerLane == 4) {
      const float4 v = *reinterpret_cast<const float4*>(src);
      acc[0] += w * v.x;
      acc[1] += w * v.y;
      acc[2] += w * v.z;
      acc[3] += w * v.w;
    } else {
      const float2 v = *reinterpret_cast<const float2*>(src);
      acc[0] += w * v.x;
      acc[1] += w * v.y;
    }
  }
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
template <typename T, int D, int kBlockM>
cudaError_t prepare_kernel(int* ctas_per_sm) {
  using Cfg = AttnCfg<D, kBlockM>;
  auto kernel = paged_attention_kernel<T, D, kBlockM>;
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

bool pdl_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("PEAGLE_DISABLE_PDL");
    return v == nullptr || v[0] == '\0' || v[0] == '0';
  }();
  return enabled;
}

template <typename T, int D>
cudaError_t launch_typed(const PagedAttentionParams& p, const PagedAttentionPlan& plan,
                         cudaStream_t stream) {
  const int32_t group = p.num_q_heads / p.num_kv_heads;
  const dim3 grid(static_cast<unsigned>(p.num_reqs + 1),
                  static_cast<unsigned>(p.num_kv_heads * plan.q_tile_ctas),
                  static_cast<unsigned>(plan.max_splits));
  cudaError_t err;
  if (plan.block_m == 64) {
    using Cfg = AttnCfg<D, 64>;
    err = prepare_kernel<T, D, 64>(nullptr);
    if (err != cudaSuccess) return err;
    paged_attention_kernel<T, D, 64><<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(
        p, group, plan.q_tile_ctas, plan.max_splits);
  } else {
    using Cfg = AttnCfg<D, 128>;
    err = prepare_kernel<T, D, 128>(nullptr);
    if (err != cudaSuccess) return err;
    paged_attention_kernel<T, D, 128><<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(
        p, group, plan.q_tile_ctas, plan.max_splits);
  }
  err = cudaGetLastError();
  if (err != cudaSuccess || !plan.needs_workspace) return err;

  // Merge: programmatic dependent launch (overlaps its launch with the main kernel's tail),
  // plain launch if the attribute is refused or PEAGLE_DISABLE_PDL=1.
  const int64_t pairs = p.num_tokens * p.num_q_heads;
  const unsigned blocks = static_cast<unsigned>((pairs + kMergeWarps - 1) / kMergeWarps);
  auto merge = paged_attention_merge_kernel<T, D>;
  if (!pdl_enabled()) {
    merge<<<blocks, kMergeWarps * 32, 0, stream>>>(p, group, plan.block_m, plan.max_splits);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kMergeWarps * 32);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  err = cudaLaunchKernelEx(&cfg, merge, p, group, plan.block_m, plan.max_splits);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    merge<<<blocks, kMergeWarps * 32, 0, stream>>>(p, group, plan.block_m, plan.max_splits);
    err = cudaGetLastError();
  }
  return err;
}

template <typename T, int D>
int ctas_per_sm_for(int block_m) {
  int n = 1;
  if (block_m == 64) {
    prepare_kernel<T, D, 64>(&n);
  } else {
    prepare_kernel<T, D, 128>(&n);
  }
  return n;
}

}  // namespace

PagedAttentionPlan plan_paged_attention(const PagedAttentionParams& p) {
  PagedAttentionPlan plan;
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  // The tile height depends on the GQA group only (never on the max_query_len hint), so a fixed
  // num_splits gives bit-identical results for any hint: G <= 4 -> 64 packed rows (a P-EAGLE
  // request of 14 rows x 4 heads = 56), G > 4 -> 128 (14 x 8 = 112).
  plan.block_m = group <= 4 ? 64 : 128;
  const int64_t rows_hint = p.max_query_len > 0 ? p.max_query_len : 1;
  const int64_t packed = group * rows_hint;
  const int64_t q_tiles = (packed + plan.block_m - 1) / plan.block_m;
  const int64_t max_q_ctas = 65535 / p.num_kv_heads;  // gridDim.y limit
  plan.q_tile_ctas = static_cast<int32_t>(q_tiles < max_q_ctas ? q_tiles : max_q_ctas);
  if (p.num_splits > 0) {
    plan.max_splits = p.num_splits;
  } else {
    int per_sm = 1;
    const bool bf16 = p.dtype == AttnDtype::kBFloat16;
    if (p.head_dim == 64) {
      per_sm = bf16 ? ctas_per_sm_for<__nv_bfloat16, 64>(plan.block_m)
                    : ctas_per_sm_for<__half, 64>(plan.block_m);
    } else {
      per_sm = bf16 ? ctas_per_sm_for<__nv_bfloat16, 128>(plan.block_m)
                    : ctas_per_sm_for<__half, 128>(plan.block_m);
    }
    // Fill one wave of resident CTAs: splits = floor(slots / CTAs without splitting).
    const int64_t slots = static_cast<int64_t>(p.num_sms > 0 ? p.num_sms : 132) * per_sm;
    const int64_t base = static_cast<int64_t>(p.num_reqs) * p.num_kv_heads * plan.q_tile_ctas;
    int64_t s = base > 0 ? slots / base : 1;
    s = s < 1 ? 1 : (s > kMaxAutoSplits ? kMaxAutoSplits : s);
    plan.max_splits = static_cast<int32_t>(s);
  }
  plan.needs_workspace = plan.max_splits > 1;
  return plan;
}

cudaError_t launch_paged_attention(const PagedAttentionParams& p, const PagedAttentionPlan& plan,
                                   cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (plan.needs_workspace && (p.ws_out == nullptr || p.ws_lse == nullptr)) {
    return cudaErrorInvalidValue;
  }
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
