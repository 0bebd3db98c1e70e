// prepare_draft_inputs: the fused P-EAGLE draft-batch step (SPEC.md §3-4), torch-free.
//
// One request r of the target (verify) batch owns rows [qs, qn) there and rows
// [qs + r*N, qn + (r+1)*N) of the drafter batch, laid out as
//   [nv copied ids][NTP row][S-1 mask rows][nrej rejected rows]      (N = S - shift)
// The per-request plan and the per-row values below are shared by the CPU loop and the CUDA
// kernel so that both compute the same function; tests compare them with an independent
// pure-PyTorch reference (tests/reference/prepare_draft_inputs.py).
#pragma once
#include <cstdint>

#include "peagle/common.h"

namespace peagle {

struct PrepareDraftInputsParams {
  // Target (verify) batch.
  const int32_t* target_token_ids = nullptr;  // [num_target_tokens]
  const int64_t* target_positions = nullptr;  // [num_target_tokens]
  const int32_t* query_start_loc = nullptr;   // [num_reqs + 1]
  const int32_t* seq_lens = nullptr;          // [num_reqs]
  // Stage A/B inputs.
  const int32_t* sampled_token_ids = nullptr;  // [num_reqs, sampled_stride], K+1 columns used
  int64_t sampled_stride = 0;
  int32_t num_sampled_cols = 0;                    // K + 1
  const bool* discard_request_mask = nullptr;      // [num_reqs]
  const int32_t* backup_next_token_ids = nullptr;  // [num_reqs]
  const int32_t* cu_num_draft_tokens = nullptr;    // [num_reqs], inclusive
  const int32_t* block_table = nullptr;            // [num_reqs, block_table_stride]
  int64_t block_table_stride = 0;
  int32_t max_blocks_per_seq = 0;
  // Hidden rows (bytes, dtype-agnostic); hidden_row_bytes == 0 disables the hidden part.
  const char* target_hidden = nullptr;  // [num_target_tokens, H]
  int64_t target_hidden_stride = 0;     // bytes between rows
  const char* mask_hidden = nullptr;    // [H] = fc(mask_hidden)
  int64_t hidden_row_bytes = 0;
  char* hidden_states = nullptr;  // [num_out_rows, H]
  int64_t hidden_stride = 0;      // bytes between rows
  // Sizes and scalars.
  int32_t num_reqs = 0;
  int64_t num_target_tokens = 0;  // capacity of the target arrays (T_in)
  int64_t num_out_rows = 0;       // capacity of the row outputs (>= T_in + B*N)
  int32_t num_slots = 0;          // S = num_padding_slots_per_request
  int32_t shift = 1;              // shift_input_ids
  int32_t mask_token_id = 0;
  int32_t padding_token_id = 0;
  int32_t block_size = 16;
  int64_t max_model_len = 0;
  int32_t vocab_size = 0;
  // Row outputs [num_out_rows].
  int32_t* input_ids = nullptr;
  int64_t* positions = nullptr;
  bool* is_rejected = nullptr;
  bool* is_masked = nullptr;
  int64_t* slot_mapping = nullptr;
  // Per-request outputs.
  int32_t* token_indices_to_sample = nullptr;     // [num_reqs * S]
  int32_t* new_query_start_loc = nullptr;         // [num_reqs + 1]
  int32_t* new_seq_lens = nullptr;                // [num_reqs]
  int32_t* next_token_ids = nullptr;              // [num_reqs]
  int32_t* valid_sampled_tokens_count = nullptr;  // [num_reqs]
};

// The workspace form of the op (prepare_draft_inputs_workspace): the host scalars travel as one
// CPU int64 tensor and the ten non-hidden outputs share three device buffers, one per dtype
// (int64, int32, bool: views of one dtype keep torch.compile able to functionalize them), so a
// call carries 16 arguments instead of 29 (the per-call dispatcher cost grows with the count).
enum DraftConfig : int {
  kCfgNumSlots = 0,  // num_padding_slots_per_request (S)
  kCfgMaskTokenId,
  kCfgPaddingTokenId,
  kCfgShift,  // shift_input_ids (0 / 1)
  kCfgBlockSize,
  kCfgMaxModelLen,
  kCfgVocabSize,
  kCfgNumOutRows,  // row capacity of the outputs
  kCfgNumReqs,     // B the workspace was laid out for
  kDraftConfigSize
};

constexpr int64_t kDraftWorkspaceAlign = 16;  // bytes; every output starts at such a boundary

// Element offsets of each output in its buffer, and each buffer's element count.
struct DraftWorkspaceLayout {
  int64_t positions, slot_mapping, i64_numel;  // int64 buffer
  int64_t input_ids, token_indices_to_sample, query_start_loc, seq_lens, next_token_ids,
      valid_sampled_tokens_count, i32_numel;   // int32 buffer
  int64_t is_rejected, is_masked, bool_numel;  // bool buffer
};

inline DraftWorkspaceLayout draft_workspace_layout(int64_t num_reqs, int64_t num_slots,
                                                   int64_t num_out_rows) {
  DraftWorkspaceLayout l{};
  // Appends n elements of `esize` bytes at *at (in elements), rounded up to the alignment.
  auto take = [](int64_t* at, int64_t n, int64_t esize) {
    const int64_t start = *at, step = kDraftWorkspaceAlign / esize;
    *at += (n + step - 1) / step * step;
    return start;
  };
  int64_t at = 0;
  l.positions = take(&at, num_out_rows, 8);
  l.slot_mapping = take(&at, num_out_rows, 8);
  l.i64_numel = at;
  at = 0;
  l.input_ids = take(&at, num_out_rows, 4);
  l.token_indices_to_sample = take(&at, num_reqs * num_slots, 4);
  l.query_start_loc = take(&at, num_reqs + 1, 4);
  l.seq_lens = take(&at, num_reqs, 4);
  l.next_token_ids = take(&at, num_reqs, 4);
  l.valid_sampled_tokens_count = take(&at, num_reqs, 4);
  l.i32_numel = at;
  at = 0;
  l.is_rejected = take(&at, num_out_rows, 1);
  l.is_masked = take(&at, num_out_rows, 1);
  l.bool_numel = at;
  return l;
}

// Stage A (SPEC §3.2) for one request: a token is valid iff 0 <= id < vocab_size.
// Columns are read in unrolled chunks of 8 so that the loads of a row are in flight together.
PEAGLE_HD void next_token_for_request(const int32_t* sampled_row, int32_t num_cols, bool discard,
                                      int32_t backup, int32_t vocab_size, int32_t* next,
                                      int32_t* valid) {
  int32_t count = 0, last = backup;
  for (int32_t c0 = 0; c0 < num_cols; c0 += 8) {
    int32_t ids[8];
#if defined(__CUDACC__)
#pragma unroll
#endif
    for (int32_t u = 0; u < 8; ++u) ids[u] = c0 + u < num_cols ? sampled_row[c0 + u] : -1;
#if defined(__CUDACC__)
#pragma unroll
#endif
    for (int32_t u = 0; u < 8; ++u) {
      if (ids[u] >= 0 && ids[u] < vocab_size) {
        ++count;
        last = ids[u];
      }
    }
  }
  *next = discard ? backup : last;
  *valid = discard ? 0 : count;
}

struct DraftRequestPlan {
  int64_t qs;    // first target row
  int32_t qlen;  // target rows
  int64_t out0;  // first drafter row = qs + r*N
  int32_t rows;  // drafter rows = qlen + N
  int32_t nv;    // copied rows before the NTP row
  int32_t nrej;  // rejected rows at the tail
  int64_t p0;    // position of the first target row
  bool padding;  // CUDA-graph padding request (qlen == 0 or seq_len == 0): inert rows only
  int32_t next_token;
  int32_t valid_count;
};

// Stages A and B for request r. Out-of-range inputs are clamped so that no access leaves its
// array (the CPU implementation reports them as errors before getting here).
PEAGLE_HD DraftRequestPlan plan_draft_request(const PrepareDraftInputsParams& p, int32_t r) {
  // Every request-level load is issued before any branch, so on the GPU they overlap.
  const int32_t qs_raw = p.query_start_loc[r];
  const int32_t qn_raw = p.query_start_loc[r + 1];
  const int32_t seq_len = p.seq_lens[r];
  const int32_t cu_r = p.cu_num_draft_tokens[r];
  const int32_t cu_prev = r > 0 ? p.cu_num_draft_tokens[r - 1] : 0;
  const bool discard = p.discard_request_mask[r];
  const int32_t backup = p.backup_next_token_ids[r];
  DraftRequestPlan plan;
  next_token_for_request(p.sampled_token_ids + static_cast<int64_t>(r) * p.sampled_stride,
                         p.num_sampled_cols, discard, backup, p.vocab_size, &plan.next_token,
                         &plan.valid_count);
  const int64_t t_in = p.num_target_tokens;
  const int64_t qs = clamp_val<int64_t>(qs_raw, 0, t_in);
  const int64_t qn = clamp_val<int64_t>(qn_raw, qs, t_in);
  const int32_t n_new = p.num_slots - p.shift;
  plan.qs = qs;
  plan.qlen = static_cast<int32_t>(qn - qs);
  plan.out0 = qs + static_cast<int64_t>(r) * n_new;
  plan.rows = plan.qlen + n_new;
  plan.padding = plan.qlen == 0 || seq_len <= 0;
  plan.p0 = 0;  // filled by the caller that needs positions (one more dependent load)
  if (plan.padding) {
    plan.next_token = kInertTokenId;
    plan.valid_count = 0;
    plan.nrej = 0;
    plan.nv = 0;
    return plan;
  }
  const int32_t n_draft = cu_r - cu_prev;
  const int32_t nrej = n_draft > 0 ? n_draft + 1 - plan.valid_count : 0;
  plan.nrej = clamp_val<int32_t>(nrej, 0, plan.qlen - 1);  // at least one valid row
  plan.nv = plan.qlen - 1 - plan.nrej + (p.shift ? 0 : 1);
  return plan;
}

// Position of the request's first target row (SPEC §3.4 p0); 0 for padding requests.
PEAGLE_HD int64_t first_position(const PrepareDraftInputsParams& p, const DraftRequestPlan& plan) {
  return plan.padding ? 0 : p.target_positions[plan.qs];
}

struct DraftRow {
  int32_t token_id;
  int64_t position;
  bool rejected;
  bool masked;
  int64_t slot;
};

// Values of drafter row j (0 <= j < plan.rows) of request r (Stage C + D).
PEAGLE_HD DraftRow draft_row(const PrepareDraftInputsParams& p, const DraftRequestPlan& plan,
                             int32_t r, int32_t j) {
  DraftRow row;
  if (plan.padding) {
    row.token_id = kInertTokenId;
    row.position = 0;
    row.rejected = true;
    row.masked = false;
    row.slot = kPaddingSlotId;
    return row;
  }
  const int32_t nv = plan.nv, s = p.num_slots;
  if (j < nv) {
    int64_t src = plan.qs + p.shift + j;
    if (src > p.num_target_tokens - 1) src = p.num_target_tokens - 1;
    row.token_id = p.target_token_ids[src];
  } else if (j == nv) {
    row.token_id = plan.next_token;
  } else if (j < nv + s) {
    row.token_id = p.mask_token_id;
  } else {
    row.token_id = p.padding_token_id;
  }
  row.rejected = j >= nv + s;
  row.masked = j > nv && j < nv + s;
  row.position = row.rejected ? 0 : plan.p0 + j;
  row.slot = kPaddingSlotId;
  if (!row.rejected && row.position >= 0 && row.position < p.max_model_len) {
    const int64_t col = row.position / p.block_size;
    if (col < p.max_blocks_per_seq) {  // keys beyond the table's capacity write nothing
      const int64_t block = p.block_table[static_cast<int64_t>(r) * p.block_table_stride + col];
      if (block >= 0) row.slot = block * p.block_size + row.position % p.block_size;
    }
  }
  return row;
}

// Source of drafter row j's hidden state: -2 = the mask vector, -1 = left untouched,
// otherwise the target row index (SPEC §4: scatter by hidden_state_mapping, mask wins).
// Depends on the plan only, so the copy can start before the row's other values are known.
PEAGLE_HD int64_t hidden_source(const DraftRequestPlan& plan, int32_t num_slots, int32_t j) {
  if (plan.padding) return -1;
  if (j > plan.nv && j < plan.nv + num_slots) return -2;
  if (j < plan.qlen) return plan.qs + j;
  return -1;
}

// First row of the padded tail (inert rows up to num_out_rows).
PEAGLE_HD int64_t draft_tail_start(const PrepareDraftInputsParams& p) {
  const int64_t qn = clamp_val<int64_t>(p.query_start_loc[p.num_reqs], 0, p.num_target_tokens);
  return qn + static_cast<int64_t>(p.num_reqs) * (p.num_slots - p.shift);
}

}  // namespace peagle

namespace peagle {
// prepare_next_token_ids (Stage A alone): [B, num_cols] sampled ids (row stride sampled_stride)
// -> next_token_ids / valid_sampled_tokens_count per request.
struct NextTokenParams {
  const int32_t* sampled_token_ids = nullptr;
  int64_t sampled_stride = 0;
  int32_t num_cols = 0;
  const bool* discard_request_mask = nullptr;
  const int32_t* backup_next_token_ids = nullptr;
  int32_t vocab_size = 0;
  int32_t num_reqs = 0;
  int32_t* next_token_ids = nullptr;
  int32_t* valid_sampled_tokens_count = nullptr;
};
}  // namespace peagle

#if defined(PEAGLE_WITH_CUDA) || defined(__CUDACC__)
#include <cuda_runtime_api.h>
namespace peagle {
// One launch: Stages A-E, hidden scatter + mask broadcast, inert tail
// (csrc/cuda/prepare_draft_inputs.cu).
cudaError_t launch_prepare_draft_inputs(const PrepareDraftInputsParams& p, cudaStream_t stream);
// Stage A alone: next_token_ids / valid_sampled_tokens_count.
cudaError_t launch_prepare_next_token_ids(const NextTokenParams& p, cudaStream_t stream);
}  // namespace peagle
#endif
