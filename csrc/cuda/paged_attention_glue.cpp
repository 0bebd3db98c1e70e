// CUDA glue for paged_attention: checks (shared with the CPU op), device guard, launch plan from
// host-known sizes, split-KV workspace (at::empty: stream-ordered, CUDA-graph safe), launch on the
// current stream. Compiled by the host compiler (BUILD.md §7).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "peagle/bind/paged_attention.h"

namespace peagle {
namespace {

int device_attr(cudaDeviceAttr attr, c10::DeviceIndex device) {
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, attr, device));
  return n;
}

void paged_attention_cuda(const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_table,
                          const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                          double softmax_scale, int64_t max_query_len, const at::Tensor& out,
                          const c10::optional<at::Tensor>& lse, int64_t window_left,
                          const c10::optional<at::Tensor>& sinks, int64_t num_splits) {
  auto bound =
      bind_paged_attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                           softmax_scale, max_query_len, out, lse, window_left, sinks, num_splits);
  // After the checks: a mixed-device call must report the argument, not fail in the guard.
  const c10::cuda::CUDAGuard guard(query.device());
  PagedAttentionParams& p = bound.params;
  if (p.num_tokens == 0) return;  // B == 0 and T == 0, or T == 0 (EDGE_CASES B2)
  const c10::DeviceIndex dev = query.device().index();
  p.num_sms = device_attr(cudaDevAttrMultiProcessorCount, dev);
  p.arch = device_attr(cudaDevAttrComputeCapabilityMajor, dev) * 10 +
           device_attr(cudaDevAttrComputeCapabilityMinor, dev);
  const PagedAttentionPlan plan = plan_paged_attention(p);
  at::Tensor ws_out, ws_lse;
  if (plan.needs_workspace) {
    const auto f32 = query.options().dtype(at::kFloat);
    ws_out = at::empty({plan.max_splits, p.num_tokens, p.num_q_heads, p.head_dim}, f32);
    ws_lse = at::empty({plan.max_splits, p.num_tokens, p.num_q_heads}, f32);
    p.ws_out = ws_out.data_ptr<float>();
    p.ws_lse = ws_lse.data_ptr<float>();
    p.max_splits = plan.max_splits;
  }
  C10_CUDA_CHECK(launch_paged_attention(p, plan, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(peagle, CUDA, m) {
  m.impl("paged_attention", &paged_attention_cuda);
}

}  // namespace peagle
