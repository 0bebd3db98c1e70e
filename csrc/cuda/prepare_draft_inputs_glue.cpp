// CUDA launchers of prepare_draft_inputs(_workspace) and prepare_next_token_ids (called by
// csrc/ops/prepare_draft_inputs.cpp after the checks): device guard, current stream, launch.
// Compiled by the host compiler (BUILD.md §7).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "peagle/backends.h"

namespace peagle {

void prepare_draft_inputs_cuda(const PrepareDraftInputsParams& p, c10::Device device) {
  // After the checks: a mixed-device call must report the argument, not fail in the guard.
  const c10::cuda::CUDAGuard guard(device);
  C10_CUDA_CHECK(launch_prepare_draft_inputs(p, c10::cuda::getCurrentCUDAStream()));
}

void prepare_next_token_ids_cuda(const NextTokenParams& p, c10::Device device) {
  const c10::cuda::CUDAGuard guard(device);
  C10_CUDA_CHECK(launch_prepare_next_token_ids(p, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace peagle
