// Device building blocks of the CUDA paged_attention kernels (csrc/cuda/paged_attention.cu):
// PTX wrappers (cp.async, ldmatrix, mma.sync, ex2, programmatic dependent launch), the key range
// and split count of a query tile (shared by the main and the merge kernel), and the
// shared-memory tile layout. Torch-free; included by paged_attention.cu only.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "peagle/kernels/paged_attention.h"

namespace peagle {
namespace attn {

constexpr int kMinTilesPerSplit = 2;  // automatic splits keep at least this many KV tiles
constexpr int kMaxAutoSplits = 64;    // automatic split cap
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

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
// 16 zero bytes -> shared memory at dst.
__device__ __forceinline__ void st_shared_zero16(uint32_t dst) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst), "r"(0u) : "memory");
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

// 32 x 32 -> 64-bit signed product (one IMAD.WIDE).
__device__ __forceinline__ int64_t mul_wide(int32_t a, int32_t b) {
  int64_t r;
  asm("mul.wide.s32 %0, %1, %2;\n" : "=l"(r) : "r"(a), "r"(b));
  return r;
}

// base + a * b, the product 32 x 32 -> 64-bit unsigned: one IMAD.WIDE.U32 with base as the 64-bit
// addend where ptxas keeps the form (it still merges two of them into two products and one
// three-input add in some kernels; either is fewer instructions than 64-bit element offsets).
__device__ __forceinline__ const char* mad_wide_u32(uint32_t a, uint32_t b, const char* base) {
  uint64_t r;
  asm("mad.wide.u32 %0, %1, %2, %3;\n" : "=l"(r) : "r"(a), "r"(b), "l"(base));
  return reinterpret_cast<const char*>(r);
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// max(a, b) that returns NaN if either is NaN (fmaxf returns the other operand).
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// Programmatic dependent launch (sm_90+; no-ops without a programmatic dependency).
// griddep_wait: this grid's reads of data written by the previous kernel in the stream must come
// after it. griddep_launch_dependents: the next kernel (launched with the PDL attribute) may be
// scheduled; it still waits for this grid's completion in its own griddep_wait.
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// mma.sync m16n8k16 (d += a (16x16, row) * b (16x8, col); fp32 accumulators) for element type
// AB ("bf16" or "f16").
#define PEAGLE_MMA_M16N8K16(AB)                                   \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." AB "." AB \
               ".f32 {%0, %1, %2, %3}, "                          \
               "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"  \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])   \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

// Tensor-core MMA, packing and zero for T = __nv_bfloat16 or __half.
template <typename T>
struct MmaOp {
  static constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  static_assert(kBf16 || std::is_same_v<T, __half>, "bf16 or fp16");
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    if constexpr (kBf16) {
      PEAGLE_MMA_M16N8K16("bf16");
    } else {
      PEAGLE_MMA_M16N8K16("f16");
    }
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    if constexpr (kBf16) {
      __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
      return *reinterpret_cast<uint32_t*>(&v);
    } else {
      __half2 v = __floats2half2_rn(lo, hi);
      return *reinterpret_cast<uint32_t*>(&v);
    }
  }
  static __device__ __forceinline__ T zero() {
    if constexpr (kBf16) {
      return __float2bfloat16(0.f);
    } else {
      return __float2half(0.f);
    }
  }
};
#undef PEAGLE_MMA_M16N8K16

// ---------------------------------------------------------------------------------------------
// Key range and split count of a query tile (main and merge kernel must agree exactly)
// ---------------------------------------------------------------------------------------------

struct TileKeys {
  int32_t lo_min;  // first key any row of the tile sees
  int32_t hi_max;  // last key any row of the tile sees (capacity-clamped)
  int32_t kt0;     // first KV tile (of block_n keys)
  int32_t ntk;     // KV tiles in [lo_min, hi_max] (0: the tile sees nothing)
  int32_t min_hi;  // last key the tile's FIRST row sees (tiles past it need the causal mask)
  int32_t max_lo;  // first key the tile's LAST row sees (tiles before it need the window mask)
};

__device__ __forceinline__ int32_t key_capacity_i32(const PagedAttentionParams& p) {
  const int64_t cap = attn_key_capacity(p);
  return cap > INT32_MAX ? INT32_MAX : static_cast<int32_t>(cap);
}

// Rows of packed tile [p0, p1) are i = p0 / G .. (p1 - 1) / G of request `a`.
__device__ __forceinline__ TileKeys tile_keys(const AttnRequest& a, int32_t p0, int32_t p1,
                                              int32_t group, int32_t window_left, int32_t cap,
                                              int32_t block_n) {
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
    k.kt0 = k.lo_min / block_n;
    k.ntk = k.hi_max / block_n - k.kt0 + 1;
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
// Non-finite values of partly masked keys
// ---------------------------------------------------------------------------------------------

// Exponent bits of a 16-bit float: all ones iff the value is inf or NaN.
template <typename T>
struct HalfBits;
template <>
struct HalfBits<__nv_bfloat16> {
  static constexpr uint32_t kExp = 0x7F80u;
};
template <>
struct HalfBits<__half> {
  static constexpr uint32_t kExp = 0x7C00u;
};

// Two packed 16-bit floats with every inf/NaN replaced by +0.
template <typename T>
__device__ __forceinline__ uint32_t scrub_pair(uint32_t x) {
  constexpr uint32_t e = HalfBits<T>::kExp;
  const uint32_t lo = (x & e) == e ? 0u : (x & 0xFFFFu);
  const uint32_t hi = ((x >> 16) & e) == e ? 0u : (x & 0xFFFF0000u);
  return lo | hi;
}

// Bit (key - key0) of keys [key0, key0 + 64) inside [lo, hi] (0 if the ranges do not meet).
__device__ __forceinline__ uint64_t key_bits(int32_t key0, int32_t lo, int32_t hi) {
  const int32_t a = max(lo - key0, 0), b = min(hi - key0, 63);
  if (a > b) return 0;
  const uint64_t upto_b = b == 63 ? ~uint64_t{0} : ((uint64_t{1} << (b + 1)) - 1);
  return upto_b & ~((uint64_t{1} << a) - 1);
}

// ---------------------------------------------------------------------------------------------
// Shared-memory tile layout
// ---------------------------------------------------------------------------------------------

// Byte offset of 16-byte chunk `chunk` (elements 8*chunk .. 8*chunk+7) of row `row` in a
// [kRows, D] bf16/fp16 tile. The tile is stored as D/64 panels of [kRows, 128 B]; inside a panel
// chunk c of row r sits at r*128 + ((c ^ (r & 7)) << 4). With a 1024-byte aligned tile this is
// exactly wgmma's 128-byte-swizzle canonical layout (K-major for Q and K, MN-major for V), and
// the 8 row addresses of an ldmatrix phase hit 8 distinct 16-byte bank groups.
template <int kRows>
__host__ __device__ __forceinline__ uint32_t tile_offset(int row, int chunk) {
  return static_cast<uint32_t>((chunk >> 3) * (kRows * 128) + row * 128 +
                               (((chunk & 7) ^ (row & 7)) << 4));
}

}  // namespace attn
}  // namespace peagle
