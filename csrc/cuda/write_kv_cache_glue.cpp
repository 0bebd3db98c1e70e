// CUDA glue for write_kv_cache: checks (shared with the CPU op), device guard, current stream,
// launch. Compiled by the host compiler (BUILD.md §7).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "peagle/bind/write_kv_cache.h"

namespace peagle {
namespace {

void write_kv_cache_cuda(const at::Tensor& key, const at::Tensor& value,
                         const at::Tensor& key_cache, const at::Tensor& value_cache,
                         const at::Tensor& slot_mapping) {
  const c10::cuda::CUDAGuard guard(key.device());
  auto bound = bind_write_kv_cache(key, value, key_cache, value_cache, slot_mapping);
  C10_CUDA_CHECK(launch_write_kv_cache(bound.params, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(peagle, CUDA, m) {
  m.impl("write_kv_cache", &write_kv_cache_cuda);
}

}  // namespace peagle
