// Every peagle op and its mutation contract, in one place (SPEC.md §0.1), one argument per line.
// Positions and meaning of every argument are fixed (the vLLM adapter and users call positionally):
// new arguments are appended with a default.
//
// Outputs are caller-provided buffers written in place (`Tensor(x!)`), so a CUDA graph can replay
// the op with persistent buffers; the functional wrappers in python/peagle/ops/<op>.py allocate
// them and register the fake kernels. Each op's one C++ entry (csrc/ops/<op>.cpp) binds and
// checks the tensors and registers itself for CPU and CUDA.
#include <torch/library.h>

#include <vector>

#include "peagle/kernels/prepare_draft_inputs.h"

// The eleven inputs both forms of the draft step take first, in this order.
#define PEAGLE_DRAFT_STEP_INPUTS           \
  "    Tensor      target_token_ids,"      \
  "    Tensor      target_positions,"      \
  "    Tensor      query_start_loc,"       \
  "    Tensor      seq_lens,"              \
  "    Tensor      sampled_token_ids,"     \
  "    Tensor      discard_request_mask,"  \
  "    Tensor      backup_next_token_ids," \
  "    Tensor      cu_num_draft_tokens,"   \
  "    Tensor      block_table,"           \
  "    Tensor?     target_hidden_states,"  \
  "    Tensor?     mask_hidden,"

TORCH_LIBRARY(peagle, m) {
  // Stage A of the draft step (SPEC §3.2): next token and valid-token count per request from the
  // previous verification output. Also fused into prepare_draft_inputs.
  m.def(
      "prepare_next_token_ids("
      "    Tensor     sampled_token_ids,"
      "    Tensor     discard_request_mask,"
      "    Tensor     backup_next_token_ids,"
      "    int        vocab_size,"
      "    Tensor(a!) next_token_ids,"
      "    Tensor(b!) valid_sampled_tokens_count"
      ") -> ()");

  // The fused draft-batch step (SPEC §3-4): Stages A-E plus the hidden-state scatter and
  // mask broadcast.
  m.def("prepare_draft_inputs(" PEAGLE_DRAFT_STEP_INPUTS
        "    int         num_padding_slots_per_request,"
        "    int         mask_token_id,"
        "    int         padding_token_id,"
        "    bool        shift_input_ids,"
        "    int         block_size,"
        "    int         max_model_len,"
        "    int         vocab_size,"
        "    Tensor(a!)  input_ids,"
        "    Tensor(b!)  positions,"
        "    Tensor(c!)  is_rejected,"
        "    Tensor(d!)  is_masked,"
        "    Tensor(e!)  token_indices_to_sample,"
        "    Tensor(f!)  slot_mapping,"
        "    Tensor(g!)  new_query_start_loc,"
        "    Tensor(h!)  new_seq_lens,"
        "    Tensor(i!)  next_token_ids,"
        "    Tensor(j!)  valid_sampled_tokens_count,"
        "    Tensor(k!)? hidden_states=None"
        ") -> ()");

  // The same step with 16 arguments instead of 29 (the per-call dispatcher cost grows with the
  // count): scalars in one CPU int64 `config` (DraftConfig order), the ten non-hidden outputs in
  // three 1-D buffers (int64, int32, bool) at the offsets of the layout op below.
  m.def("prepare_draft_inputs_workspace(" PEAGLE_DRAFT_STEP_INPUTS
        "    Tensor      config,"
        "    Tensor(a!)  workspace_i64,"
        "    Tensor(b!)  workspace_i32,"
        "    Tensor(c!)  workspace_bool,"
        "    Tensor(d!)? hidden_states=None"
        ") -> ()");
  // Element offsets: [positions, slot_mapping, i64 numel, input_ids, token_indices_to_sample,
  // query_start_loc, seq_lens, next_token_ids, valid_sampled_tokens_count, i32 numel,
  // is_rejected, is_masked, bool numel].
  m.def(
      "prepare_draft_inputs_workspace_layout("
      "    int num_reqs,"
      "    int num_padding_slots_per_request,"
      "    int num_out_rows"
      ") -> int[]",
      [](int64_t num_reqs, int64_t num_slots, int64_t num_out_rows) {
        TORCH_CHECK(num_reqs >= 0 && num_slots >= 1 && num_out_rows >= 0,
                    "peagle: workspace layout needs num_reqs >= 0, "
                    "num_padding_slots_per_request >= 1, num_out_rows >= 0, got ",
                    num_reqs, ", ", num_slots, ", ", num_out_rows);
        const peagle::DraftWorkspaceLayout l =
            peagle::draft_workspace_layout(num_reqs, num_slots, num_out_rows);
        return std::vector<int64_t>{l.positions,
                                    l.slot_mapping,
                                    l.i64_numel,
                                    l.input_ids,
                                    l.token_indices_to_sample,
                                    l.query_start_loc,
                                    l.seq_lens,
                                    l.next_token_ids,
                                    l.valid_sampled_tokens_count,
                                    l.i32_numel,
                                    l.is_rejected,
                                    l.is_masked,
                                    l.bool_numel};
      });

  // New K/V rows into the paged cache at slot_mapping; PADDING_SLOT_ID (-1) rows write nothing.
  m.def(
      "write_kv_cache("
      "    Tensor     key,"
      "    Tensor     value,"
      "    Tensor(a!) key_cache,"
      "    Tensor(b!) value_cache,"
      "    Tensor     slot_mapping"
      ") -> ()");

  // Causal (bottom-right) attention of ragged query rows over a paged KV cache (SPEC §5).
  // window_left < 0: no sliding window; sinks: per-head logits added to the softmax denominator;
  // num_splits 0: split-KV count chosen on the device, > 0: fixed (bit-reproducible).
  m.def(
      "paged_attention("
      "    Tensor      query,"
      "    Tensor      key_cache,"
      "    Tensor      value_cache,"
      "    Tensor      block_table,"
      "    Tensor      query_start_loc,"
      "    Tensor      seq_lens,"
      "    float       softmax_scale,"
      "    int         max_query_len,"
      "    Tensor(a!)  out,"
      "    Tensor(b!)? lse=None,"
      "    int         window_left=-1,"
      "    Tensor?     sinks=None,"
      "    int         num_splits=0"
      ") -> ()");

  // Tree-free (chain) verification straight from target logits (SPEC §6). bonus_token_ids and
  // exponentials (vLLM parity: the bonus token sampled outside, the recovered token by the
  // exponential race) were appended last so positional callers keep working.
  m.def(
      "verify_chain("
      "    Tensor      target_logits,"
      "    Tensor      draft_token_ids,"
      "    Tensor      cu_num_draft_tokens,"
      "    Tensor      temperature,"
      "    Tensor      seeds,"
      "    Tensor      offsets,"
      "    Tensor(a!)  output_token_ids,"
      "    Tensor(b!)  num_accepted,"
      "    Tensor?     top_k=None,"
      "    Tensor?     top_p=None,"
      "    Tensor?     draft_probs=None,"
      "    Tensor?     uniforms=None,"
      "    Tensor?     request_mask=None,"
      "    Tensor(c!)? accepted_per_position=None,"
      "    Tensor?     bonus_token_ids=None,"
      "    Tensor?     exponentials=None"
      ") -> ()");
}
