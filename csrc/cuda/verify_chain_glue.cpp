// CUDA launcher of verify_chain (called by csrc/ops/verify_chain.cpp after the checks): device
// guard, scratch workspace from the caching allocator (graph-safe: allocated from the capture pool
// when capturing), current stream, launch. Compiled by the host compiler (BUILD.md §7).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "peagle/backends.h"

namespace peagle {

void verify_chain_cuda(const VerifyChainParams& p, c10::Device device) {
  // After the checks: a mixed-device call must report the argument, not fail in the guard.
  const c10::cuda::CUDAGuard guard(device);
  if (p.num_reqs == 0) return;
  const size_t bytes = verify_chain_workspace_bytes(p);
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().device(device).dtype(at::kByte));
  C10_CUDA_CHECK(launch_verify_chain(p, workspace.data_ptr(), c10::cuda::getCurrentCUDAStream()));
}

}  // namespace peagle
