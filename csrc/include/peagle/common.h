// Torch-free definitions shared by the CPU implementations (.cpp) and the CUDA kernels (.cu).
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define PEAGLE_HD __host__ __device__ __forceinline__
#else
#define PEAGLE_HD inline
#endif

namespace peagle {

// Sentinels fixed across the library (SPEC.md §0).
constexpr int64_t kPaddingSlotId = -1;       // slot_mapping: this row writes no KV
constexpr int32_t kPlaceholderTokenId = -1;  // token outputs: "no token here"
constexpr int32_t kInertTokenId = 0;         // token id of inert rows (padding requests, padded tail)

template <typename T>
PEAGLE_HD T clamp_val(T v, T lo, T hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

}  // namespace peagle
