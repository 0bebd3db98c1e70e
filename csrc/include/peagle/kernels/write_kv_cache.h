// write_kv_cache: new K/V rows into the paged cache at slot_mapping (SPEC.md §5), torch-free.
//
// Row t of key/value ([T, Hkv, D]) goes to cache block slot / block_size, offset
// slot % block_size. PADDING_SLOT_ID (-1) rows write nothing. The CPU op raises on any other
// negative slot and on slots past the cache; the CUDA kernel skips them (no out-of-bounds write).
// Copies are bytewise, so the element type only enters through elem_bytes.
#pragma once
#include <cstdint>

#include "peagle/common.h"

namespace peagle {

struct WriteKvCacheParams {
  const char* key = nullptr;                   // [T, Hkv, D]
  const char* value = nullptr;                 // [T, Hkv, D]
  int64_t key_stride_t = 0, key_stride_h = 0;  // elements
  int64_t value_stride_t = 0, value_stride_h = 0;
  char* key_cache = nullptr;    // [num_blocks, block_size, Hkv, D]
  char* value_cache = nullptr;  // [num_blocks, block_size, Hkv, D]
  int64_t kc_stride_block = 0, kc_stride_slot = 0, kc_stride_head = 0;  // elements
  int64_t vc_stride_block = 0, vc_stride_slot = 0, vc_stride_head = 0;
  const int64_t* slot_mapping = nullptr;  // [T]
  int64_t num_tokens = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t elem_bytes = 2;
  int64_t num_blocks = 0;
  int32_t block_size = 0;
};

// True iff `slot` addresses a cache row (the CUDA kernel skips every other slot).
PEAGLE_HD bool kv_slot_in_cache(int64_t slot, int64_t num_blocks, int32_t block_size) {
  return slot >= 0 && slot < num_blocks * block_size;
}

}  // namespace peagle

#if defined(PEAGLE_WITH_CUDA) || defined(__CUDACC__)
#include <cuda_runtime_api.h>
namespace peagle {
// One launch, no host sync (csrc/cuda/write_kv_cache.cu).
cudaError_t launch_write_kv_cache(const WriteKvCacheParams& p, cudaStream_t stream);
}  // namespace peagle
#endif
