// CUDA launcher of paged_attention (called by csrc/ops/paged_attention.cpp after the checks):
// device guard, device facts and launch plan from host-known sizes, split-KV workspace
// (at::empty: stream-ordered, CUDA-graph safe), launch on the current stream. Compiled by the
// host compiler (BUILD.md §7).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "launch.cuh"
#include "peagle/backends.h"

namespace peagle {
namespace {

int device_attr(cudaDeviceAttr attr, c10::DeviceIndex device) {
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, attr, device));
  return n;
}

}  // namespace

void paged_attention_cuda(PagedAttentionParams& p, c10::Device device) {
  // After the checks: a mixed-device call must report the argument, not fail in the guard.
  const c10::cuda::CUDAGuard guard(device);
  if (p.num_tokens == 0) return;  // B == 0 and T == 0, or T == 0 (EDGE_CASES B2)
  const c10::DeviceIndex dev = device.index();
  p.num_sms = sm_count(dev);
  p.arch = device_attr(cudaDevAttrComputeCapabilityMajor, dev) * 10 +
           device_attr(cudaDevAttrComputeCapabilityMinor, dev);
  const PagedAttentionPlan plan = plan_paged_attention(p);
  at::Tensor ws_out, ws_lse;
  if (plan.needs_workspace) {
    const auto f32 = at::TensorOptions().device(device).dtype(at::kFloat);
    ws_out = at::empty({plan.max_splits, p.num_tokens, p.num_q_heads, p.head_dim}, f32);
    ws_lse = at::empty({plan.max_splits, p.num_tokens, p.num_q_heads}, f32);
    p.ws_out = ws_out.data_ptr<float>();
    p.ws_lse = ws_lse.data_ptr<float>();
    p.max_splits = plan.max_splits;
  }
  C10_CUDA_CHECK(launch_paged_attention(p, plan, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace peagle
