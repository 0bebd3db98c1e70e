// wgmma (sm_90a) building blocks of the CUDA paged_attention kernel: shared-memory matrix
// descriptors for the 128-byte-swizzle tiles of paged_attention_device.cuh (tile_offset), the
// warpgroup fences, and m64nNk16 wgmma.mma_async with A in registers (fp32 accumulators).
//
// Register layouts (PTX ISA "wgmma" register fragments; identical to mma.sync m16n8k16 per warp):
// warp w of a warpgroup owns rows 16w .. 16w+15 of the m64 tile; lane l holds rows 16w + l/4 and
// 16w + l/4 + 8. Accumulator d[j][0..1] = (row l/4, columns 8j + 2(l%4) + {0,1}), d[j][2..3] =
// the same columns of row l/4 + 8. A fragment a[0] = (row l/4, k 2(l%4) + {0,1}), a[1] = (row
// l/4 + 8, same k), a[2] = (row l/4, k + 8), a[3] = (row l/4 + 8, k + 8) -- the mma.sync A
// fragment, so ldmatrix-loaded Q and the S -> P repacking of the mma.sync path serve both.
//
// Shared-memory descriptors (PTX ISA "matrix descriptor"; bit layout as CuTe's GmmaDescriptor):
// bits 0-13 start address >> 4, 16-29 leading byte offset >> 4, 32-45 stride byte offset >> 4,
// 62-63 swizzle mode (1 = 128-byte swizzle). Canonical 128B-swizzle layouts (CuTe
// make_gmma_desc, in 16-byte units):
//   K-major  ((8,n),2):((8,SBO),1)          rows 128 B apart, 8-row groups SBO apart; one
//            instruction reads 16 elements (32 B) of K; further k16 steps inside the 128-byte
//            row advance the start address by 32 B; LBO unused (1).
//   MN-major ((8,n),(8,k)):((1,LBO),(8,SBO)) 64 MN-elements (128 B) contiguous, MN panels LBO
//            apart; K rows 128 B apart, 8-row groups SBO apart.
// The swizzle is applied to absolute shared-memory address bits (bits 4-6 ^= bits 7-9), so every
// tile base must be 1024-byte aligned (checked by the kernel).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

// wgmma exists on sm_90a only (the arch-specific feature set); elsewhere the wrappers trap and
// the host never selects the wgmma kernel (PagedAttentionPlan::impl).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PEAGLE_ATTN_HAS_WGMMA 1
#else
#define PEAGLE_ATTN_HAS_WGMMA 0
#endif

namespace peagle {
namespace attn {

// 128-byte-swizzle shared-memory matrix descriptor of the operand at shared-memory byte address
// smem_byte_addr (the summed form: the address masked to the CTA's window, as the PTX encoding).
__host__ __device__ __forceinline__ uint64_t wgmma_desc(uint32_t smem_byte_addr, uint32_t lbo_bytes,
                                                        uint32_t sbo_bytes) {
  return static_cast<uint64_t>((smem_byte_addr & 0x3FFFFu) >> 4) |
         (static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFFu) << 16) |
         (static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFFu) << 32) | (uint64_t{1} << 62);
}

// The same descriptor of the operand at shared-memory byte address
// tile + 16 * start_off16. The 14-bit start field takes address bits 4-17 of the CTA's own window
// (228 KB at most); a CTA of a cluster launch has its rank in the address bits above those (its
// shared::cta window lies inside the shared::cluster one), so the tile's start is masked, once
// per tile. A k16 step's descriptor is then that plus a compile-time constant in the low word (the
// offset within a tile never carries out of the field): one add per step where the form with the
// address summed first took an add, a mask, a shift and an or (tools/check_paged_attention_gmma.cu
// checks both forms agree on every 1024-byte-aligned tile, with and without rank bits).
__host__ __device__ __forceinline__ uint64_t wgmma_desc_at(uint32_t tile, uint32_t start_off16,
                                                           uint32_t lbo_bytes, uint32_t sbo_bytes) {
  const uint32_t start16 = (tile & 0x3FFFFu) >> 4;
  const uint32_t lo = start16 + start_off16 + ((lbo_bytes >> 4) << 16);  // start, leading offset
  const uint32_t hi = (sbo_bytes >> 4) | (1u << 30);  // stride offset, swizzle mode 1 (bit 62)
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// Descriptor of k16 step kk (head-dim elements 16kk .. 16kk+15) of a K tile at smem address
// `tile` ([kRows keys, D] in tile_offset's layout) as the K-major B operand of S = Q K^T: 32 bytes
// into 128-byte panel kk / 4; rows 128 B apart, 8-row groups 1024 B apart. The same layout serves
// a warpgroup's 64 rows of the Q tile as the A operand (kRows = the Q tile's rows).
// kStep: wgmma_desc_at's form (tile start + per-step constant), else the summed form; the same
// descriptor either way.
template <int kRows, bool kStep = true>
__host__ __device__ __forceinline__ uint64_t k_operand_desc(uint32_t tile, int kk) {
  if constexpr (kStep) {
    return wgmma_desc_at(tile, ((kk >> 2) * (kRows * 128) + (kk & 3) * 32) >> 4, 16, 1024);
  } else {
    return wgmma_desc(tile + (kk >> 2) * (kRows * 128) + (kk & 3) * 32, 16, 1024);
  }
}
// Descriptor of k16 step kk (keys 16kk .. 16kk+15) of a V tile at smem address `tile` as the
// MN-major B operand of O += P V: rows 128 B apart, 8-row groups 1024 B apart, 64-column panels
// kRows * 128 B apart (the leading byte offset).
template <int kRows, bool kStep = true>
__host__ __device__ __forceinline__ uint64_t v_operand_desc(uint32_t tile, int kk) {
  if constexpr (kStep) {
    return wgmma_desc_at(tile, (kk * 16 * 128) >> 4, kRows * 128, 1024);
  } else {
    return wgmma_desc(tile + kk * 16 * 128, kRows * 128, 1024);
  }
}

// Before the first wgmma of a batch whose accumulator or A registers were touched by ordinary
// instructions.
__device__ __forceinline__ void wgmma_fence() {
#if PEAGLE_ATTN_HAS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if PEAGLE_ATTN_HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if PEAGLE_ATTN_HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Orders generic-proxy shared-memory writes (cp.async data this thread waited for) before later
// async-proxy reads (wgmma operands); a barrier then extends it to the other threads.
__device__ __forceinline__ void fence_proxy_async_smem() {
#if PEAGLE_ATTN_HAS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Keeps the compiler from moving register reads/writes of an accumulator across wgmma
// issue/wait points (the asm statements are volatile, so they keep their order).
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
  }
}

// wgmma.mma_async m64nNk16 with A in registers and B from a shared-memory descriptor, for the
// element type AB ("bf16" or "f16"): D (+)= A * B, scale_d == 0 -> D = A * B; TRANS: B is
// MN-major (1) or K-major (0). One macro per N (the operand lists differ); each function below
// expands it once per element type.
#define PEAGLE_WGMMA_D4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define PEAGLE_WGMMA_AB_IN "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d)

#define PEAGLE_WGMMA_M64N32K16(AB)                                                     \
  asm volatile(                                                                        \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"                                     \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." AB "." AB                          \
      " "                                                                              \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "       \
      "{%16, %17, %18, %19}, %20, p, 1, 1, %22;\n}\n"                                  \
      : PEAGLE_WGMMA_D4(0), PEAGLE_WGMMA_D4(1), PEAGLE_WGMMA_D4(2), PEAGLE_WGMMA_D4(3) \
      : PEAGLE_WGMMA_AB_IN, "n"(kTransB))

#define PEAGLE_WGMMA_M64N64K16(AB)                                                      \
  asm volatile(                                                                         \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                      \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." AB "." AB                           \
      " "                                                                               \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "         \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, "     \
      "%31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"                             \
      : PEAGLE_WGMMA_D4(0), PEAGLE_WGMMA_D4(1), PEAGLE_WGMMA_D4(2), PEAGLE_WGMMA_D4(3), \
        PEAGLE_WGMMA_D4(4), PEAGLE_WGMMA_D4(5), PEAGLE_WGMMA_D4(6), PEAGLE_WGMMA_D4(7)  \
      : PEAGLE_WGMMA_AB_IN, "n"(kTransB))

#define PEAGLE_WGMMA_M64N128K16(AB)                                                            \
  asm volatile(                                                                                \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                             \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." AB "." AB                                 \
      " "                                                                                      \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "  \
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "  \
      "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "                               \
      "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"                                          \
      : PEAGLE_WGMMA_D4(0), PEAGLE_WGMMA_D4(1), PEAGLE_WGMMA_D4(2), PEAGLE_WGMMA_D4(3),        \
        PEAGLE_WGMMA_D4(4), PEAGLE_WGMMA_D4(5), PEAGLE_WGMMA_D4(6), PEAGLE_WGMMA_D4(7),        \
        PEAGLE_WGMMA_D4(8), PEAGLE_WGMMA_D4(9), PEAGLE_WGMMA_D4(10), PEAGLE_WGMMA_D4(11),      \
        PEAGLE_WGMMA_D4(12), PEAGLE_WGMMA_D4(13), PEAGLE_WGMMA_D4(14), PEAGLE_WGMMA_D4(15)     \
      : PEAGLE_WGMMA_AB_IN, "n"(kTransB))

// The same with A from shared memory too (desc_a, K-major) and B K-major.
#define PEAGLE_WGMMA_SS_IN "l"(desc_a), "l"(desc_b), "r"(scale_d)
#define PEAGLE_WGMMA_M64N32K16_SS(AB)                                                  \
  asm volatile(                                                                        \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                     \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." AB "." AB                          \
      " "                                                                              \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "       \
      "%16, %17, p, 1, 1, 0, 0;\n}\n"                                                  \
      : PEAGLE_WGMMA_D4(0), PEAGLE_WGMMA_D4(1), PEAGLE_WGMMA_D4(2), PEAGLE_WGMMA_D4(3) \
      : PEAGLE_WGMMA_SS_IN)
#define PEAGLE_WGMMA_M64N64K16_SS(AB)                                                   \
  asm volatile(                                                                         \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                      \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." AB "." AB                           \
      " "                                                                               \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "         \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, "     \
      "%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"                                             \
      : PEAGLE_WGMMA_D4(0), PEAGLE_WGMMA_D4(1), PEAGLE_WGMMA_D4(2), PEAGLE_WGMMA_D4(3), \
        PEAGLE_WGMMA_D4(4), PEAGLE_WGMMA_D4(5), PEAGLE_WGMMA_D4(6), PEAGLE_WGMMA_D4(7)  \
      : PEAGLE_WGMMA_SS_IN)

// Expands WGMMA("bf16") or WGMMA("f16") for T; traps where wgmma does not exist.
#if PEAGLE_ATTN_HAS_WGMMA
#define PEAGLE_WGMMA_FOR(T, WGMMA)                  \
  if constexpr (std::is_same_v<T, __nv_bfloat16>) { \
    WGMMA("bf16");                                  \
  } else {                                          \
    WGMMA("f16");                                   \
  }
#else
#define PEAGLE_WGMMA_FOR(T, WGMMA) (void)d, (void)a, (void)desc_b, (void)scale_d, __trap()
#endif
#if PEAGLE_ATTN_HAS_WGMMA
#define PEAGLE_WGMMA_SS_FOR(T, WGMMA) PEAGLE_WGMMA_FOR(T, WGMMA)
#else
#define PEAGLE_WGMMA_SS_FOR(T, WGMMA) (void)d, (void)desc_a, (void)desc_b, (void)scale_d, __trap()
#endif

// D[64 x N] (+)= A[64 x 16] (registers) * B[16 x N] (shared-memory descriptor desc_b).
template <typename T, int kTransB>
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[4][4], const uint32_t (&a)[4],
                                                uint64_t desc_b, int scale_d) {
  PEAGLE_WGMMA_FOR(T, PEAGLE_WGMMA_M64N32K16);
}
template <typename T, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[8][4], const uint32_t (&a)[4],
                                                uint64_t desc_b, int scale_d) {
  PEAGLE_WGMMA_FOR(T, PEAGLE_WGMMA_M64N64K16);
}
template <typename T, int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[16][4], const uint32_t (&a)[4],
                                                 uint64_t desc_b, int scale_d) {
  PEAGLE_WGMMA_FOR(T, PEAGLE_WGMMA_M64N128K16);
}

// D[64 x N] (+)= A[64 x 16] * B[16 x N], both K-major in shared memory (descriptors).
template <typename T>
__device__ __forceinline__ void wgmma_m64n32k16_ss(float (&d)[4][4], uint64_t desc_a,
                                                   uint64_t desc_b, int scale_d) {
  PEAGLE_WGMMA_SS_FOR(T, PEAGLE_WGMMA_M64N32K16_SS);
}
template <typename T>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[8][4], uint64_t desc_a,
                                                   uint64_t desc_b, int scale_d) {
  PEAGLE_WGMMA_SS_FOR(T, PEAGLE_WGMMA_M64N64K16_SS);
}

#undef PEAGLE_WGMMA_SS_FOR
#undef PEAGLE_WGMMA_M64N64K16_SS
#undef PEAGLE_WGMMA_M64N32K16_SS
#undef PEAGLE_WGMMA_SS_IN
#undef PEAGLE_WGMMA_FOR
#undef PEAGLE_WGMMA_M64N128K16
#undef PEAGLE_WGMMA_M64N64K16
#undef PEAGLE_WGMMA_M64N32K16
#undef PEAGLE_WGMMA_AB_IN
#undef PEAGLE_WGMMA_D4

}  // namespace attn
}  // namespace peagle
