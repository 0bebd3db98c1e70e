// prepare_draft_inputs, prepare_draft_inputs_workspace and prepare_next_token_ids: each op's one
// torch-facing entry (schemas in csrc/registration.cpp). Tensors -> PrepareDraftInputsParams (or
// NextTokenParams) with every shape/dtype/device check, then the CPU kernel
// (csrc/cpu/prepare_draft_inputs.cpp) or the CUDA launcher
// (csrc/cuda/prepare_draft_inputs_glue.cpp) on the params. The two draft-step ops differ only in
// how the outputs are passed.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <vector>

#include "peagle/backends.h"
#include "peagle/torch_checks.h"

namespace peagle {

struct BoundPrepareDraftInputs {
  PrepareDraftInputsParams params;
  std::vector<at::Tensor> keep_alive;  // contiguous copies of strided inputs
};

// Checks the next-token (Stage A) arguments shared by both draft-step ops.
inline void check_next_token_args(const at::Tensor& sampled_token_ids,
                                  const at::Tensor& discard_request_mask,
                                  const at::Tensor& backup_next_token_ids, int64_t vocab_size,
                                  const at::Tensor& next_token_ids,
                                  const at::Tensor& valid_sampled_tokens_count) {
  check_dtype(sampled_token_ids, "sampled_token_ids", at::kInt);
  check_dim(sampled_token_ids, "sampled_token_ids", 2);
  const int64_t b = sampled_token_ids.size(0);
  TORCH_CHECK(sampled_token_ids.size(1) >= 1,
              "peagle: sampled_token_ids must have K+1 >= 1 columns, got shape ",
              shape_str(sampled_token_ids));
  check_dtype(discard_request_mask, "discard_request_mask", at::kBool);
  check_shape(discard_request_mask, "discard_request_mask", {b});
  check_dtype(backup_next_token_ids, "backup_next_token_ids", at::kInt);
  check_shape(backup_next_token_ids, "backup_next_token_ids", {b});
  TORCH_CHECK(vocab_size > 0 && vocab_size <= INT32_MAX,
              "peagle: vocab_size must be in [1, 2^31), got ", vocab_size);
  for (auto [t, name] : {std::pair{&next_token_ids, "next_token_ids"},
                         std::pair{&valid_sampled_tokens_count, "valid_sampled_tokens_count"}}) {
    check_dtype(*t, name, at::kInt);
    check_shape(*t, name, {b});
    check_contiguous(*t, name);
  }
  for (auto [t, name] : {std::pair{&discard_request_mask, "discard_request_mask"},
                         std::pair{&backup_next_token_ids, "backup_next_token_ids"},
                         std::pair{&next_token_ids, "next_token_ids"},
                         std::pair{&valid_sampled_tokens_count, "valid_sampled_tokens_count"}}) {
    check_device(*t, name, sampled_token_ids, "sampled_token_ids");
  }
}

// Inputs, scalars and (optionally) the hidden part -> params; `t_out` is the row capacity of the
// outputs, already read from them. Shared by both output forms (separate tensors or workspace).
inline void bind_draft_step(BoundPrepareDraftInputs& bound, const at::Tensor& target_token_ids,
                            const at::Tensor& target_positions, const at::Tensor& query_start_loc,
                            const at::Tensor& seq_lens, const at::Tensor& sampled_token_ids,
                            const at::Tensor& discard_request_mask,
                            const at::Tensor& backup_next_token_ids,
                            const at::Tensor& cu_num_draft_tokens, const at::Tensor& block_table,
                            const c10::optional<at::Tensor>& target_hidden_states,
                            const c10::optional<at::Tensor>& mask_hidden,
                            int64_t num_padding_slots_per_request, int64_t mask_token_id,
                            int64_t padding_token_id, bool shift_input_ids, int64_t block_size,
                            int64_t max_model_len, int64_t vocab_size, int64_t t_out,
                            const c10::optional<at::Tensor>& hidden_states) {
  auto& p = bound.params;
  // Inputs are read through contiguous views (a copy only when strided), kept alive until launch.
  auto in = [&](const at::Tensor& t) -> at::Tensor {
    if (t.is_contiguous()) return t;
    at::Tensor c = t.contiguous();
    bound.keep_alive.push_back(c);
    return c;
  };

  // Target batch.
  check_dtype(target_token_ids, "target_token_ids", at::kInt);
  check_dim(target_token_ids, "target_token_ids", 1);
  const int64_t t_in = target_token_ids.size(0);
  check_dtype(target_positions, "target_positions", at::kLong);
  check_shape(target_positions, "target_positions", {t_in});
  check_dtype(query_start_loc, "query_start_loc", at::kInt);
  check_dim(query_start_loc, "query_start_loc", 1);
  TORCH_CHECK(query_start_loc.size(0) >= 1, "peagle: query_start_loc must have B+1 >= 1 entries");
  const int64_t b = query_start_loc.size(0) - 1;
  check_dtype(seq_lens, "seq_lens", at::kInt);
  check_shape(seq_lens, "seq_lens", {b});
  check_dim(sampled_token_ids, "sampled_token_ids", 2);
  TORCH_CHECK(sampled_token_ids.size(0) == b, "peagle: sampled_token_ids has ",
              sampled_token_ids.size(0), " rows but query_start_loc describes B=", b, " requests");
  check_dtype(sampled_token_ids, "sampled_token_ids", at::kInt);
  check_dtype(discard_request_mask, "discard_request_mask", at::kBool);
  check_shape(discard_request_mask, "discard_request_mask", {b});
  check_dtype(backup_next_token_ids, "backup_next_token_ids", at::kInt);
  check_shape(backup_next_token_ids, "backup_next_token_ids", {b});
  TORCH_CHECK(vocab_size > 0 && vocab_size <= INT32_MAX,
              "peagle: vocab_size must be in [1, 2^31), got ", vocab_size);
  check_dtype(cu_num_draft_tokens, "cu_num_draft_tokens", at::kInt);
  check_shape(cu_num_draft_tokens, "cu_num_draft_tokens", {b});
  check_dtype(block_table, "block_table", at::kInt);
  check_dim(block_table, "block_table", 2);
  TORCH_CHECK(block_table.size(0) == b, "peagle: block_table must have B=", b, " rows, got shape ",
              shape_str(block_table));
  for (auto [t, name] :
       {std::pair{&target_positions, "target_positions"},
        std::pair{&query_start_loc, "query_start_loc"}, std::pair{&seq_lens, "seq_lens"},
        std::pair{&sampled_token_ids, "sampled_token_ids"},
        std::pair{&discard_request_mask, "discard_request_mask"},
        std::pair{&backup_next_token_ids, "backup_next_token_ids"},
        std::pair{&cu_num_draft_tokens, "cu_num_draft_tokens"},
        std::pair{&block_table, "block_table"}}) {
    check_device(*t, name, target_token_ids, "target_token_ids");
  }

  // Scalars.
  const int64_t s = num_padding_slots_per_request;
  TORCH_CHECK(s >= 1 && s <= 1024,
              "peagle: num_padding_slots_per_request must be in [1, 1024], got ", s);
  const int64_t shift = shift_input_ids ? 1 : 0;
  const int64_t n_new = s - shift;
  TORCH_CHECK(mask_token_id >= 0 && mask_token_id < vocab_size, "peagle: mask_token_id ",
              mask_token_id, " is outside the vocabulary [0, ", vocab_size, ")");
  TORCH_CHECK(padding_token_id >= 0 && padding_token_id < vocab_size, "peagle: padding_token_id ",
              padding_token_id, " is outside the vocabulary [0, ", vocab_size, ")");
  TORCH_CHECK(block_size > 0 && block_size <= (1 << 20),
              "peagle: block_size must be positive, got ", block_size);
  TORCH_CHECK(max_model_len > 0, "peagle: max_model_len must be positive, got ", max_model_len);

  // Row outputs: at least T_in + B*N rows (EDGE_CASES C4: the rejected tail is counted).
  const int64_t t_out_min = t_in + b * n_new;
  TORCH_CHECK(t_out >= t_out_min, "peagle: drafter row outputs need at least T_in + B*N = ", t_in,
              " + ", b, "*", n_new, " = ", t_out_min, " rows, the outputs have ", t_out);

  // Hidden part: all three tensors or none; only with the EAGLE shift (SPEC §3.4).
  const bool has_hidden = target_hidden_states.has_value();
  TORCH_CHECK(has_hidden == mask_hidden.has_value() && has_hidden == hidden_states.has_value(),
              "peagle: target_hidden_states, mask_hidden and hidden_states must be given together");
  if (has_hidden) {
    TORCH_CHECK(
        shift_input_ids,
        "peagle: hidden states are only moved with shift_input_ids=True (EAGLE drafters); "
        "pass target_hidden_states/mask_hidden/hidden_states=None for shift_input_ids=False");
    const at::Tensor& th = *target_hidden_states;
    const at::Tensor& mh = *mask_hidden;
    const at::Tensor& oh = *hidden_states;
    TORCH_CHECK(is_float_dtype(th.scalar_type()),
                "peagle: target_hidden_states must be float32/float16/bfloat16, got ",
                th.scalar_type());
    check_dim(th, "target_hidden_states", 2);
    TORCH_CHECK(th.size(0) == t_in, "peagle: target_hidden_states must have T_in=", t_in,
                " rows, got shape ", shape_str(th));
    const int64_t h = th.size(1);
    TORCH_CHECK(h >= 1, "peagle: hidden size must be >= 1");
    check_dtype(mh, "mask_hidden", th.scalar_type());
    TORCH_CHECK(mh.numel() == h, "peagle: mask_hidden must hold H=", h,
                " values (the fc-projected mask_hidden), got shape ", shape_str(mh));
    check_dtype(oh, "hidden_states", th.scalar_type());
    check_dim(oh, "hidden_states", 2);
    TORCH_CHECK(oh.size(0) >= t_out_min && oh.size(1) == h,
                "peagle: hidden_states must have shape [>= T_in + B*N = ", t_out_min, ", ", h,
                "], got ", shape_str(oh));
    check_rows_contiguous(oh, "hidden_states");
    check_device(th, "target_hidden_states", target_token_ids, "target_token_ids");
    check_device(mh, "mask_hidden", target_token_ids, "target_token_ids");
    check_device(oh, "hidden_states", target_token_ids, "target_token_ids");
    const at::Tensor thc = th.stride(1) == 1 ? th : in(th);
    const at::Tensor mhc = in(mh);  // [H] or [1, 1, H]: H contiguous values
    const int64_t esize = th.element_size();
    p.target_hidden = static_cast<const char*>(thc.data_ptr());
    p.target_hidden_stride = thc.stride(0) * esize;
    p.mask_hidden = static_cast<const char*>(mhc.data_ptr());
    p.hidden_row_bytes = h * esize;
    p.hidden_states = static_cast<char*>(oh.data_ptr());
    p.hidden_stride = oh.stride(0) * esize;
  }

  const at::Tensor sampled =
      sampled_token_ids.stride(1) == 1 ? sampled_token_ids : in(sampled_token_ids);
  const at::Tensor bt = block_table.stride(1) == 1 ? block_table : in(block_table);
  p.target_token_ids = in(target_token_ids).data_ptr<int32_t>();
  p.target_positions = in(target_positions).data_ptr<int64_t>();
  p.query_start_loc = in(query_start_loc).data_ptr<int32_t>();
  p.seq_lens = in(seq_lens).data_ptr<int32_t>();
  p.sampled_token_ids = sampled.data_ptr<int32_t>();
  p.sampled_stride = sampled.stride(0);
  p.num_sampled_cols = static_cast<int32_t>(sampled.size(1));
  p.discard_request_mask = in(discard_request_mask).data_ptr<bool>();
  p.backup_next_token_ids = in(backup_next_token_ids).data_ptr<int32_t>();
  p.cu_num_draft_tokens = in(cu_num_draft_tokens).data_ptr<int32_t>();
  p.block_table = bt.data_ptr<int32_t>();
  p.block_table_stride = bt.stride(0);
  p.max_blocks_per_seq = static_cast<int32_t>(bt.size(1));
  p.num_reqs = static_cast<int32_t>(b);
  p.num_target_tokens = t_in;
  p.num_out_rows = t_out;
  p.num_slots = static_cast<int32_t>(s);
  p.shift = static_cast<int32_t>(shift);
  p.mask_token_id = static_cast<int32_t>(mask_token_id);
  p.padding_token_id = static_cast<int32_t>(padding_token_id);
  p.block_size = static_cast<int32_t>(block_size);
  p.max_model_len = max_model_len;
  p.vocab_size = static_cast<int32_t>(vocab_size);
}

void prepare_draft_inputs(
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
  BoundPrepareDraftInputs bound;
  auto& p = bound.params;
  check_dtype(input_ids, "input_ids", at::kInt);
  check_dim(input_ids, "input_ids", 1);
  const int64_t t_out = input_ids.size(0);
  bind_draft_step(bound, target_token_ids, target_positions, query_start_loc, seq_lens,
                  sampled_token_ids, discard_request_mask, backup_next_token_ids,
                  cu_num_draft_tokens, block_table, target_hidden_states, mask_hidden,
                  num_padding_slots_per_request, mask_token_id, padding_token_id, shift_input_ids,
                  block_size, max_model_len, vocab_size, t_out, hidden_states);
  const int64_t b = p.num_reqs, s = p.num_slots;
  check_next_token_args(sampled_token_ids, discard_request_mask, backup_next_token_ids, vocab_size,
                        next_token_ids, valid_sampled_tokens_count);
  for (auto [t, name, dt] : {std::tuple{&positions, "positions", at::kLong},
                             std::tuple{&is_rejected, "is_rejected", at::kBool},
                             std::tuple{&is_masked, "is_masked", at::kBool},
                             std::tuple{&slot_mapping, "slot_mapping", at::kLong}}) {
    check_dtype(*t, name, dt);
    check_shape(*t, name, {t_out});
  }
  check_dtype(token_indices_to_sample, "token_indices_to_sample", at::kInt);
  check_shape(token_indices_to_sample, "token_indices_to_sample", {b * s});
  check_dtype(new_query_start_loc, "new_query_start_loc", at::kInt);
  check_shape(new_query_start_loc, "new_query_start_loc", {b + 1});
  check_dtype(new_seq_lens, "new_seq_lens", at::kInt);
  check_shape(new_seq_lens, "new_seq_lens", {b});
  for (auto [t, name] : {std::pair{&input_ids, "input_ids"}, std::pair{&positions, "positions"},
                         std::pair{&is_rejected, "is_rejected"}, std::pair{&is_masked, "is_masked"},
                         std::pair{&slot_mapping, "slot_mapping"},
                         std::pair{&token_indices_to_sample, "token_indices_to_sample"},
                         std::pair{&new_query_start_loc, "new_query_start_loc"},
                         std::pair{&new_seq_lens, "new_seq_lens"}}) {
    check_contiguous(*t, name);
    check_device(*t, name, target_token_ids, "target_token_ids");
  }
  p.input_ids = input_ids.data_ptr<int32_t>();
  p.positions = positions.data_ptr<int64_t>();
  p.is_rejected = is_rejected.data_ptr<bool>();
  p.is_masked = is_masked.data_ptr<bool>();
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.token_indices_to_sample = token_indices_to_sample.data_ptr<int32_t>();
  p.new_query_start_loc = new_query_start_loc.data_ptr<int32_t>();
  p.new_seq_lens = new_seq_lens.data_ptr<int32_t>();
  p.next_token_ids = next_token_ids.data_ptr<int32_t>();
  p.valid_sampled_tokens_count = valid_sampled_tokens_count.data_ptr<int32_t>();
  PEAGLE_RUN(prepare_draft_inputs, p, target_token_ids);
}

// The workspace form: `config` is a CPU int64 tensor [kDraftConfigSize] (DraftConfig order) and
// the ten non-hidden outputs live in three 1-D buffers (int64, int32, bool) at the element
// offsets of draft_workspace_layout().
void prepare_draft_inputs_workspace(
    const at::Tensor& target_token_ids, const at::Tensor& target_positions,
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
    const at::Tensor& sampled_token_ids, const at::Tensor& discard_request_mask,
    const at::Tensor& backup_next_token_ids, const at::Tensor& cu_num_draft_tokens,
    const at::Tensor& block_table, const c10::optional<at::Tensor>& target_hidden_states,
    const c10::optional<at::Tensor>& mask_hidden, const at::Tensor& config,
    const at::Tensor& workspace_i64, const at::Tensor& workspace_i32,
    const at::Tensor& workspace_bool, const c10::optional<at::Tensor>& hidden_states) {
  TORCH_CHECK(config.device().is_cpu() && config.scalar_type() == at::kLong && config.dim() == 1 &&
                  config.size(0) == kDraftConfigSize && config.is_contiguous(),
              "peagle: config must be a contiguous CPU int64 tensor of ", kDraftConfigSize,
              " values (DraftInputsWorkspace builds it), got ", config.scalar_type(), " ",
              shape_str(config), " on ", config.device());
  const int64_t* c = config.data_ptr<int64_t>();
  TORCH_CHECK(c[kCfgShift] == 0 || c[kCfgShift] == 1,
              "peagle: config[shift_input_ids] must be 0 or 1, got ", c[kCfgShift]);
  const int64_t t_out = c[kCfgNumOutRows];
  BoundPrepareDraftInputs bound;
  auto& p = bound.params;
  bind_draft_step(bound, target_token_ids, target_positions, query_start_loc, seq_lens,
                  sampled_token_ids, discard_request_mask, backup_next_token_ids,
                  cu_num_draft_tokens, block_table, target_hidden_states, mask_hidden,
                  c[kCfgNumSlots], c[kCfgMaskTokenId], c[kCfgPaddingTokenId], c[kCfgShift] != 0,
                  c[kCfgBlockSize], c[kCfgMaxModelLen], c[kCfgVocabSize], t_out, hidden_states);
  TORCH_CHECK(c[kCfgNumReqs] == p.num_reqs,
              "peagle: the workspace was laid out for B=", c[kCfgNumReqs],
              " requests but query_start_loc describes B=", p.num_reqs);
  const DraftWorkspaceLayout lay = draft_workspace_layout(p.num_reqs, p.num_slots, t_out);
  auto base = [&](const at::Tensor& ws, const char* name, at::ScalarType dtype, int64_t numel) {
    check_dtype(ws, name, dtype);
    check_dim(ws, name, 1);
    check_contiguous(ws, name);
    check_device(ws, name, target_token_ids, "target_token_ids");
    TORCH_CHECK(ws.numel() >= numel, "peagle: ", name, " needs ", numel,
                " elements for B=", p.num_reqs, ", S=", p.num_slots, ", ", t_out, " rows, got ",
                ws.numel());
    char* ptr = static_cast<char*>(ws.data_ptr());
    TORCH_CHECK(reinterpret_cast<uintptr_t>(ptr) % kDraftWorkspaceAlign == 0, "peagle: ", name,
                " must be ", kDraftWorkspaceAlign, "-byte aligned");
    return ptr;
  };
  auto* w64 =
      reinterpret_cast<int64_t*>(base(workspace_i64, "workspace_i64", at::kLong, lay.i64_numel));
  auto* w32 =
      reinterpret_cast<int32_t*>(base(workspace_i32, "workspace_i32", at::kInt, lay.i32_numel));
  auto* wb =
      reinterpret_cast<bool*>(base(workspace_bool, "workspace_bool", at::kBool, lay.bool_numel));
  p.positions = w64 + lay.positions;
  p.slot_mapping = w64 + lay.slot_mapping;
  p.input_ids = w32 + lay.input_ids;
  p.token_indices_to_sample = w32 + lay.token_indices_to_sample;
  p.new_query_start_loc = w32 + lay.query_start_loc;
  p.new_seq_lens = w32 + lay.seq_lens;
  p.next_token_ids = w32 + lay.next_token_ids;
  p.valid_sampled_tokens_count = w32 + lay.valid_sampled_tokens_count;
  p.is_rejected = wb + lay.is_rejected;
  p.is_masked = wb + lay.is_masked;
  PEAGLE_RUN(prepare_draft_inputs, p, target_token_ids);
}

// Stage A alone (SPEC §3.2).
void prepare_next_token_ids(const at::Tensor& sampled_token_ids,
                            const at::Tensor& discard_request_mask,
                            const at::Tensor& backup_next_token_ids, int64_t vocab_size,
                            const at::Tensor& next_token_ids,
                            const at::Tensor& valid_sampled_tokens_count) {
  check_next_token_args(sampled_token_ids, discard_request_mask, backup_next_token_ids, vocab_size,
                        next_token_ids, valid_sampled_tokens_count);
  const at::Tensor sampled =
      sampled_token_ids.stride(1) == 1 ? sampled_token_ids : sampled_token_ids.contiguous();
  const at::Tensor discard = discard_request_mask.contiguous();
  const at::Tensor backup = backup_next_token_ids.contiguous();
  NextTokenParams p;
  p.sampled_token_ids = sampled.data_ptr<int32_t>();
  p.sampled_stride = sampled.stride(0);
  p.num_cols = static_cast<int32_t>(sampled.size(1));
  p.discard_request_mask = discard.data_ptr<bool>();
  p.backup_next_token_ids = backup.data_ptr<int32_t>();
  p.vocab_size = static_cast<int32_t>(vocab_size);
  p.num_reqs = static_cast<int32_t>(sampled.size(0));
  p.next_token_ids = next_token_ids.data_ptr<int32_t>();
  p.valid_sampled_tokens_count = valid_sampled_tokens_count.data_ptr<int32_t>();
  PEAGLE_RUN(prepare_next_token_ids, p, sampled_token_ids);
}

PEAGLE_IMPL("prepare_draft_inputs", &prepare_draft_inputs);
PEAGLE_IMPL("prepare_draft_inputs_workspace", &prepare_draft_inputs_workspace);
PEAGLE_IMPL("prepare_next_token_ids", &prepare_next_token_ids);

}  // namespace peagle
