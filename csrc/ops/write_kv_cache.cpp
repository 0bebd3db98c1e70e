// write_kv_cache: the op's one torch-facing entry (schema in csrc/registration.cpp). Tensors ->
// WriteKvCacheParams with every shape/dtype/device check, then the CPU kernel
// (csrc/cpu/write_kv_cache.cpp) or the CUDA launcher (csrc/cuda/write_kv_cache_glue.cpp) on the
// params. Caches are never copied: strided views (e.g. the halves of a [2, num_blocks, ...] cache)
// are written through their strides.
#include <ATen/core/Tensor.h>

#include <vector>

#include "peagle/backends.h"
#include "peagle/torch_checks.h"

namespace peagle {

struct BoundWriteKvCache {
  WriteKvCacheParams params;
  std::vector<at::Tensor> keep_alive;  // contiguous copy of a strided slot_mapping
};

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  BoundWriteKvCache bound;
  auto& p = bound.params;
  TORCH_CHECK(is_float_dtype(key.scalar_type()),
              "peagle: write_kv_cache: key must be bfloat16/float16/float32, got ",
              key.scalar_type());
  check_dim(key, "key", 3);
  const int64_t t = key.size(0), hkv = key.size(1), d = key.size(2);
  TORCH_CHECK(hkv >= 1 && d >= 1, "peagle: key must have Hkv >= 1 and D >= 1, got shape ",
              shape_str(key));
  check_dtype(value, "value", key.scalar_type());
  check_shape(value, "value", {t, hkv, d});
  check_dim(key_cache, "key_cache", 4);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  TORCH_CHECK(block_size >= 1, "peagle: key_cache must have block_size >= 1, got shape ",
              shape_str(key_cache));
  for (auto [c, name] :
       {std::pair{&key_cache, "key_cache"}, std::pair{&value_cache, "value_cache"}}) {
    check_dtype(*c, name, key.scalar_type());
    check_shape(*c, name, {num_blocks, block_size, hkv, d});
    check_device(*c, name, key, "key");
  }
  for (auto [x, name] :
       {std::pair{&key, "key"}, std::pair{&value, "value"}, std::pair{&key_cache, "key_cache"},
        std::pair{&value_cache, "value_cache"}}) {
    check_rows_contiguous(*x, name);
  }
  check_device(value, "value", key, "key");
  check_dtype(slot_mapping, "slot_mapping", at::kLong);
  check_shape(slot_mapping, "slot_mapping", {t});
  check_device(slot_mapping, "slot_mapping", key, "key");
  TORCH_CHECK(block_size <= INT32_MAX && d <= INT32_MAX && hkv <= INT32_MAX,
              "peagle: write_kv_cache sizes must fit in int32, got cache shape ",
              shape_str(key_cache));

  const at::Tensor slots = slot_mapping.contiguous();
  bound.keep_alive.push_back(slots);
  p.key = static_cast<const char*>(key.data_ptr());
  p.value = static_cast<const char*>(value.data_ptr());
  p.key_stride_t = key.stride(0);
  p.key_stride_h = key.stride(1);
  p.value_stride_t = value.stride(0);
  p.value_stride_h = value.stride(1);
  p.key_cache = static_cast<char*>(key_cache.data_ptr());
  p.value_cache = static_cast<char*>(value_cache.data_ptr());
  p.kc_stride_block = key_cache.stride(0);
  p.kc_stride_slot = key_cache.stride(1);
  p.kc_stride_head = key_cache.stride(2);
  p.vc_stride_block = value_cache.stride(0);
  p.vc_stride_slot = value_cache.stride(1);
  p.vc_stride_head = value_cache.stride(2);
  p.slot_mapping = slots.data_ptr<int64_t>();
  p.num_tokens = t;
  p.num_kv_heads = static_cast<int32_t>(hkv);
  p.head_dim = static_cast<int32_t>(d);
  p.elem_bytes = static_cast<int32_t>(key.element_size());
  p.num_blocks = num_blocks;
  p.block_size = static_cast<int32_t>(block_size);
  PEAGLE_RUN(write_kv_cache, p, key);
}

PEAGLE_IMPL("write_kv_cache", &write_kv_cache);

}  // namespace peagle
