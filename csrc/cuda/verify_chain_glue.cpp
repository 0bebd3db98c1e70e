// CUDA glue for verify_chain: checks (shared with the CPU op), device guard, scratch workspace
// from the caching allocator (graph-safe: allocated from the capture pool when capturing),
// current stream, launch. Compiled by the host compiler (BUILD.md §7).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "peagle/bind/verify_chain.h"

namespace peagle {
namespace {

void verify_chain_cuda(const at::Tensor& target_logits, const at::Tensor& draft_token_ids,
                       const at::Tensor& cu_num_draft_tokens, const at::Tensor& temperature,
                       const at::Tensor& seeds, const at::Tensor& offsets,
                       const at::Tensor& output_token_ids, const at::Tensor& num_accepted,
                       const c10::optional<at::Tensor>& top_k,
                       const c10::optional<at::Tensor>& top_p,
                       const c10::optional<at::Tensor>& draft_probs,
                       const c10::optional<at::Tensor>& uniforms,
                       const c10::optional<at::Tensor>& request_mask,
                       const c10::optional<at::Tensor>& accepted_per_position,
                       const c10::optional<at::Tensor>& bonus_token_ids,
                       const c10::optional<at::Tensor>& exponentials) {
  auto bound = bind_verify_chain(target_logits, draft_token_ids, cu_num_draft_tokens, temperature,
                                 seeds, offsets, output_token_ids, num_accepted, top_k, top_p,
                                 draft_probs, uniforms, request_mask, accepted_per_position,
                                 bonus_token_ids, exponentials);
  // After the checks: a mixed-device call must report the argument, not fail in the guard.
  const c10::cuda::CUDAGuard guard(target_logits.device());
  const VerifyChainParams& p = bound.params;
  if (p.num_reqs == 0) return;
  const size_t bytes = verify_chain_workspace_bytes(p);
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(bytes)}, target_logits.options().dtype(at::kByte));
  C10_CUDA_CHECK(launch_verify_chain(p, workspace.data_ptr(), c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(peagle, CUDA, m) {
  m.impl("verify_chain", &verify_chain_cuda);
}

}  // namespace peagle
