// CPU implementation of write_kv_cache (SPEC.md §5): row t of key/value is copied to slot
// slot_mapping[t] of the paged caches; PADDING_SLOT_ID (-1) rows write nothing. Unlike the CUDA
// kernel (which skips them), this op raises on any other negative slot and on slots past the
// cache, before writing anything.
#include <ATen/Parallel.h>

#include <cstring>

#include "peagle/backends.h"
#include "peagle/torch_checks.h"

namespace peagle {
namespace {

void check_slots(const WriteKvCacheParams& p) {
  const int64_t capacity = p.num_blocks * p.block_size;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t s = p.slot_mapping[t];
    TORCH_CHECK(
        s == kPaddingSlotId || kv_slot_in_cache(s, p.num_blocks, p.block_size),
        "peagle: write_kv_cache: slot_mapping[", t, "] = ", s,
        " is neither PADDING_SLOT_ID (-1) nor a slot of the cache (num_blocks * block_size = ",
        p.num_blocks, " * ", p.block_size, " = ", capacity, ")");
  }
}

// Copies one [Hkv, D] row (unit stride in D) to its cache slot.
void copy_row(const char* src, int64_t src_stride_h, char* dst, int64_t dst_stride_h,
              const WriteKvCacheParams& p) {
  const int64_t row_bytes = static_cast<int64_t>(p.head_dim) * p.elem_bytes;
  for (int32_t h = 0; h < p.num_kv_heads; ++h) {
    std::memcpy(dst + h * dst_stride_h * p.elem_bytes, src + h * src_stride_h * p.elem_bytes,
                row_bytes);
  }
}

}  // namespace

void write_kv_cache_cpu(const WriteKvCacheParams& p) {
  if (p.num_tokens == 0) return;
  check_slots(p);
  const int64_t e = p.elem_bytes;
  // Rows with equal slots race; which one lands is unspecified (as on CUDA).
  at::parallel_for(0, p.num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = p.slot_mapping[t];
      if (s == kPaddingSlotId) continue;
      const int64_t blk = s / p.block_size, off = s % p.block_size;
      copy_row(p.key + t * p.key_stride_t * e, p.key_stride_h,
               p.key_cache + (blk * p.kc_stride_block + off * p.kc_stride_slot) * e,
               p.kc_stride_head, p);
      copy_row(p.value + t * p.value_stride_t * e, p.value_stride_h,
               p.value_cache + (blk * p.vc_stride_block + off * p.vc_stride_slot) * e,
               p.vc_stride_head, p);
    }
  });
}

}  // namespace peagle
