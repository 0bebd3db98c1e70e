// CPU implementation of prepare_draft_inputs and prepare_next_token_ids (SPEC.md §3-4).
// It runs the same per-request plan and per-row rule as the CUDA kernel
// (peagle/kernels/prepare_draft_inputs.h) and, unlike the CUDA path, checks input values and
// raises on bad ones (the CUDA path cannot without a host sync; it clamps instead).
#include <ATen/Parallel.h>

#include <cstring>

#include "peagle/backends.h"
#include "peagle/torch_checks.h"

namespace peagle {
namespace {

void check_values(const PrepareDraftInputsParams& p) {
  const int32_t* qsl = p.query_start_loc;
  TORCH_CHECK(p.num_reqs == 0 || qsl[0] >= 0, "peagle: query_start_loc[0] must be >= 0, got ",
              qsl[0]);
  for (int32_t r = 0; r < p.num_reqs; ++r) {
    TORCH_CHECK(qsl[r + 1] >= qsl[r], "peagle: query_start_loc must be non-decreasing, got [", r,
                "]=", qsl[r], " > [", r + 1, "]=", qsl[r + 1]);
    TORCH_CHECK(p.seq_lens[r] >= 0, "peagle: seq_lens[", r, "] = ", p.seq_lens[r], " is negative");
    const int32_t prev = r > 0 ? p.cu_num_draft_tokens[r - 1] : 0;
    TORCH_CHECK(p.cu_num_draft_tokens[r] >= prev,
                "peagle: cu_num_draft_tokens must be a non-decreasing inclusive cumsum, got [", r,
                "]=", p.cu_num_draft_tokens[r], " after ", prev);
  }
  TORCH_CHECK(p.num_reqs == 0 || qsl[p.num_reqs] <= p.num_target_tokens,
              "peagle: query_start_loc[B] = ", qsl[p.num_reqs],
              " exceeds T_in = ", p.num_target_tokens);
  for (int32_t r = 0; r < p.num_reqs; ++r) {
    const int32_t qlen = qsl[r + 1] - qsl[r];
    if (qlen == 0 || p.seq_lens[r] == 0) continue;  // padding request: inputs are ignored
    TORCH_CHECK(p.seq_lens[r] >= qlen, "peagle: request ", r, " has seq_len ", p.seq_lens[r],
                " < query length ", qlen);
    int32_t next = 0, valid = 0;
    next_token_for_request(p.sampled_token_ids + r * p.sampled_stride, p.num_sampled_cols,
                           p.discard_request_mask[r], p.backup_next_token_ids[r], p.vocab_size,
                           &next, &valid);
    TORCH_CHECK(next >= 0 && next < p.vocab_size, "peagle: request ", r,
                " needs its backup_next_token_ids entry (", p.backup_next_token_ids[r],
                ") but it is not a token in [0, ", p.vocab_size, ")");
    const int32_t n_draft = p.cu_num_draft_tokens[r] - (r > 0 ? p.cu_num_draft_tokens[r - 1] : 0);
    const int32_t nrej = n_draft > 0 ? n_draft + 1 - valid : 0;
    TORCH_CHECK(nrej >= 0 && nrej <= qlen - 1, "peagle: request ", r, " has ", n_draft,
                " drafts and ", valid, " valid sampled tokens, so ", nrej,
                " rejected rows, which must be in [0, query length - 1 = ", qlen - 1, "]");
  }
}

void run_prepare_draft_inputs_cpu(const PrepareDraftInputsParams& p) {
  check_values(p);
  const int64_t n_new = p.num_slots - p.shift;
  at::parallel_for(0, p.num_reqs, 1, [&](int64_t begin, int64_t end) {
    for (int32_t r = static_cast<int32_t>(begin); r < end; ++r) {
      DraftRequestPlan plan = plan_draft_request(p, r);
      plan.p0 = first_position(p, plan);
      p.next_token_ids[r] = plan.next_token;
      p.valid_sampled_tokens_count[r] = plan.valid_count;
      p.new_query_start_loc[r] = p.query_start_loc[r] + static_cast<int32_t>(r * n_new);
      p.new_seq_lens[r] =
          plan.padding ? p.seq_lens[r] : p.seq_lens[r] + static_cast<int32_t>(n_new);
      for (int32_t j = 0; j < plan.rows; ++j) {
        const DraftRow row = draft_row(p, plan, r, j);
        const int64_t o = plan.out0 + j;
        if (!plan.padding && !row.rejected && row.position < p.max_model_len) {
          TORCH_CHECK(row.slot >= 0, "peagle: request ", r, " position ", row.position,
                      " needs block_table[", r, ", ", row.position / p.block_size,
                      "] but the row has ", p.max_blocks_per_seq,
                      " columns or holds a negative block id");
        }
        p.input_ids[o] = row.token_id;
        p.positions[o] = row.position;
        p.is_rejected[o] = row.rejected;
        p.is_masked[o] = row.masked;
        p.slot_mapping[o] = row.slot;
        if (!plan.padding && j >= plan.nv && j < plan.nv + p.num_slots) {
          p.token_indices_to_sample[static_cast<int64_t>(r) * p.num_slots + (j - plan.nv)] =
              static_cast<int32_t>(o);
        }
        if (p.hidden_row_bytes > 0) {
          const int64_t src = hidden_source(plan, p.num_slots, j);
          char* dst = p.hidden_states + o * p.hidden_stride;
          if (src == -2) {
            std::memcpy(dst, p.mask_hidden, p.hidden_row_bytes);
          } else if (src >= 0) {
            std::memcpy(dst, p.target_hidden + src * p.target_hidden_stride, p.hidden_row_bytes);
          }
        }
      }
      if (plan.padding) {  // its sample indices point at its own first (inert) row
        const int64_t first = clamp_val<int64_t>(plan.out0, 0, p.num_out_rows - 1);
        for (int32_t k = 0; k < p.num_slots; ++k) {
          p.token_indices_to_sample[static_cast<int64_t>(r) * p.num_slots + k] =
              static_cast<int32_t>(first);
        }
      }
    }
  });
  p.new_query_start_loc[p.num_reqs] =
      p.query_start_loc[p.num_reqs] + static_cast<int32_t>(p.num_reqs * n_new);
  for (int64_t o = draft_tail_start(p); o < p.num_out_rows; ++o) {
    p.input_ids[o] = kInertTokenId;
    p.positions[o] = 0;
    p.is_rejected[o] = false;
    p.is_masked[o] = false;
    p.slot_mapping[o] = kPaddingSlotId;
  }
}

}  // namespace

void prepare_draft_inputs_cpu(const PrepareDraftInputsParams& p) {
  run_prepare_draft_inputs_cpu(p);
}

void prepare_next_token_ids_cpu(const NextTokenParams& p) {
  for (int32_t r = 0; r < p.num_reqs; ++r) {
    int32_t next = 0, valid = 0;
    next_token_for_request(p.sampled_token_ids + r * p.sampled_stride, p.num_cols,
                           p.discard_request_mask[r], p.backup_next_token_ids[r], p.vocab_size,
                           &next, &valid);
    p.next_token_ids[r] = next;
    p.valid_sampled_tokens_count[r] = valid;
  }
}

}  // namespace peagle
