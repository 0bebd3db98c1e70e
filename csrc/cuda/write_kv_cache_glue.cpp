// CUDA launcher of write_kv_cache (called by csrc/ops/write_kv_cache.cpp after the checks):
// device guard, current stream, launch. Compiled by the host compiler (BUILD.md §7).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "peagle/backends.h"

namespace peagle {

void write_kv_cache_cuda(const WriteKvCacheParams& p, c10::Device device) {
  // After the checks: a mixed-device call must report the argument, not fail in the guard.
  const c10::cuda::CUDAGuard guard(device);
  C10_CUDA_CHECK(launch_write_kv_cache(p, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace peagle
