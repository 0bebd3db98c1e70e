// CUDA glue for prepare_draft_inputs / prepare_next_token_ids: checks (shared with the CPU op),
// device guard, current stream, launch. Compiled by the host compiler (BUILD.md §7).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "peagle/bind/prepare_draft_inputs.h"

namespace peagle {
namespace {

void prepare_draft_inputs_cuda(
    const at::Tensor& target_token_ids, const at::Tensor& target_positions,
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
    const at::Tensor& sampled_token_ids, const at::Tensor& discard_request_mask,
    const at::Tensor& backup_next_token_ids, const at::Tensor& cu_num_draft_tokens,
    const at::Tensor& block_table, const c10::optional<at::Tensor>& target_hidden_states,
    const c10::optional<at::Tensor>& mask_hidden, int64_t num_padding_slots_per_request,
    int64_t mask_token_id, int64_t padding_token_id, bool shift_input_ids, int64_t block_size,
    int64_t max_model_len, int64_t vocab_size, const at::Tensor& input_ids,
    const at::Tensor& positions, const at::Tensor& is_rejected, const at::Tensor& is_masked,
    const at::Tensor& token_indices_to_sample, const at::Tensor& slot_mapping,
    const at::Tensor& new_query_start_loc, const at::Tensor& new_seq_lens,
    const at::Tensor& next_token_ids, const at::Tensor& valid_sampled_tokens_count,
    const c10::optional<at::Tensor>& hidden_states) {
  auto bound = bind_prepare_draft_inputs(
      target_token_ids, target_positions, query_start_loc, seq_lens, sampled_token_ids,
      discard_request_mask, backup_next_token_ids, cu_num_draft_tokens, block_table,
      target_hidden_states, mask_hidden, num_padding_slots_per_request, mask_token_id,
      padding_token_id, shift_input_ids, block_size, max_model_len, vocab_size, input_ids,
      positions, is_rejected, is_masked, token_indices_to_sample, slot_mapping, new_query_start_loc,
      new_seq_lens, next_token_ids, valid_sampled_tokens_count, hidden_states);
  // After the checks: a mixed-device call must report the argument, not fail in the guard.
  const c10::cuda::CUDAGuard guard(target_token_ids.device());
  C10_CUDA_CHECK(launch_prepare_draft_inputs(bound.params, c10::cuda::getCurrentCUDAStream()));
}

void prepare_draft_inputs_workspace_cuda(
    const at::Tensor& target_token_ids, const at::Tensor& target_positions,
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
    const at::Tensor& sampled_token_ids, const at::Tensor& discard_request_mask,
    const at::Tensor& backup_next_token_ids, const at::Tensor& cu_num_draft_tokens,
    const at::Tensor& block_table, const c10::optional<at::Tensor>& target_hidden_states,
    const c10::optional<at::Tensor>& mask_hidden, const at::Tensor& config,
    const at::Tensor& workspace_i64, const at::Tensor& workspace_i32,
    const at::Tensor& workspace_bool, const c10::optional<at::Tensor>& hidden_states) {
  auto bound = bind_prepare_draft_inputs_workspace(
      target_token_ids, target_positions, query_start_loc, seq_lens, sampled_token_ids,
      discard_request_mask, backup_next_token_ids, cu_num_draft_tokens, block_table,
      target_hidden_states, mask_hidden, config, workspace_i64, workspace_i32, workspace_bool,
      hidden_states);
  const c10::cuda::CUDAGuard guard(target_token_ids.device());
  C10_CUDA_CHECK(launch_prepare_draft_inputs(bound.params, c10::cuda::getCurrentCUDAStream()));
}

void prepare_next_token_ids_cuda(const at::Tensor& sampled_token_ids,
                                 const at::Tensor& discard_request_mask,
                                 const at::Tensor& backup_next_token_ids, int64_t vocab_size,
                                 const at::Tensor& next_token_ids,
                                 const at::Tensor& valid_sampled_tokens_count) {
  check_next_token_args(sampled_token_ids, discard_request_mask, backup_next_token_ids, vocab_size,
                        next_token_ids, valid_sampled_tokens_count);
  const c10::cuda::CUDAGuard guard(sampled_token_ids.device());
  const at::Tensor sampled =
      sampled_token_ids.stride(1) == 1 ? sampled_token_ids : sampled_token_ids.contiguous();
  const at::Tensor discard = discard_request_mask.contiguous();
  const at::Tensor backup = backup_next_token_ids.contiguous();
  C10_CUDA_CHECK(launch_prepare_next_token_ids(
      sampled.data_ptr<int32_t>(), sampled.stride(0), static_cast<int32_t>(sampled.size(1)),
      discard.data_ptr<bool>(), backup.data_ptr<int32_t>(), static_cast<int32_t>(vocab_size),
      static_cast<int32_t>(sampled.size(0)), next_token_ids.data_ptr<int32_t>(),
      valid_sampled_tokens_count.data_ptr<int32_t>(), c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(peagle, CUDA, m) {
  m.impl("prepare_draft_inputs", &prepare_draft_inputs_cuda);
  m.impl("prepare_draft_inputs_workspace", &prepare_draft_inputs_workspace_cuda);
  m.impl("prepare_next_token_ids", &prepare_next_token_ids_cuda);
}

}  // namespace peagle
