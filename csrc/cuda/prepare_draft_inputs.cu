// CUDA prepare_draft_inputs: the whole P-EAGLE draft-batch step in ONE launch (torch-free).
//
// Work is split by drafter output row, not by request, so ragged batches (long prefills next
// to decodes) stay balanced: block b owns rows [b*R, (b+1)*R). Each block
//   1. stages the target query_start_loc in shared memory,
//   2. for each of its rows (one thread per row) finds the owning request by binary search,
//      recomputes that request's Stage A/B plan (a few cached loads) and writes the row's id,
//      position, flags, slot and, for sampled rows, the sample index,
//   3. copies the hidden rows with all its threads: target rows with 16-byte vectors when
//      everything is 16-byte aligned (narrower otherwise), mask rows from fc(mask_hidden).
// Threads with global index r < B also write request r's per-request outputs. The padded tail
// [T_in + B*N, num_out_rows) is written inert. No host sync, CUDA-graph safe.
#include <cuda_runtime.h>

#include <cstdint>

#include "peagle/kernels/prepare_draft_inputs.h"

namespace peagle {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxRowsPerBlock = 32;
constexpr int kSmemQslEntries = 8192;  // larger batches search query_start_loc in global memory

// Largest r in [0, b) with start(r) = qsl[r] + r*n_new <= o (clamped like plan_draft_request).
__device__ __forceinline__ int32_t find_request(const int32_t* qsl, int32_t b, int64_t t_in,
                                                int32_t n_new, int64_t o) {
  int32_t lo = 0, hi = b - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) >> 1;
    const int64_t start = clamp_val<int64_t>(qsl[mid], 0, t_in) + static_cast<int64_t>(mid) * n_new;
    if (start <= o) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <typename Vec>
__device__ __forceinline__ void copy_rows(const PrepareDraftInputsParams& p, const int64_t* dst_row,
                                          const int64_t* src_row, int rows) {
  // rows <= kMaxRowsPerBlock and a row is < 2^31 bytes, so 32-bit indices suffice.
  const uint32_t n_vec = static_cast<uint32_t>(p.hidden_row_bytes / static_cast<int64_t>(sizeof(Vec)));
  const uint32_t total = n_vec * static_cast<uint32_t>(rows);
  // Unrolled by 4 so that several independent loads are in flight per thread.
  for (uint32_t base = threadIdx.x; base < total; base += 4 * kThreads) {
    Vec v[4];
    uint32_t idx[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      idx[u] = base + u * kThreads;
      if (idx[u] < total) {
        const uint32_t i = idx[u] / n_vec;
        const uint32_t c = idx[u] - i * n_vec;
        const int64_t src = src_row[i];
        const Vec* s = src == -2 ? reinterpret_cast<const Vec*>(p.mask_hidden)
                                 : reinterpret_cast<const Vec*>(p.target_hidden + src * p.target_hidden_stride);
        v[u] = s[c];
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (idx[u] < total) {
        const uint32_t i = idx[u] / n_vec;
        const uint32_t c = idx[u] - i * n_vec;
        reinterpret_cast<Vec*>(p.hidden_states + dst_row[i] * p.hidden_stride)[c] = v[u];
      }
    }
  }
}

template <int kVecBytes>
__global__ void __launch_bounds__(kThreads)
    prepare_draft_inputs_kernel(const PrepareDraftInputsParams p, int rows_per_block) {
  extern __shared__ int32_t smem_qsl[];
  __shared__ int64_t s_dst[kMaxRowsPerBlock];
  __shared__ int64_t s_src[kMaxRowsPerBlock];
  __shared__ int s_num_copies;

  const int32_t b = p.num_reqs;
  const int32_t n_new = p.num_slots - p.shift;
  const bool qsl_in_smem = b + 1 <= kSmemQslEntries;
  for (int i = threadIdx.x; qsl_in_smem && i <= b; i += kThreads) smem_qsl[i] = p.query_start_loc[i];
  if (threadIdx.x == 0) s_num_copies = 0;
  __syncthreads();
  const int32_t* qsl = qsl_in_smem ? smem_qsl : p.query_start_loc;

  // Per-request outputs (one thread per request across the grid).
  const int64_t gid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (gid < b) {
    const int32_t r = static_cast<int32_t>(gid);
    const DraftRequestPlan plan = plan_draft_request(p, r);
    p.next_token_ids[r] = plan.next_token;
    p.valid_sampled_tokens_count[r] = plan.valid_count;
    p.new_query_start_loc[r] = p.query_start_loc[r] + r * n_new;
    p.new_seq_lens[r] = plan.padding ? p.seq_lens[r] : p.seq_lens[r] + n_new;
    if (plan.padding) {
      const int64_t first = clamp_val<int64_t>(plan.out0, 0, p.num_out_rows - 1);
      for (int32_t k = 0; k < p.num_slots; ++k)
        p.token_indices_to_sample[static_cast<int64_t>(r) * p.num_slots + k] = static_cast<int32_t>(first);
    }
  }
  if (gid == 0) p.new_query_start_loc[b] = p.query_start_loc[b] + b * n_new;

  // Row outputs.
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  if (threadIdx.x < rows_per_block && row0 + threadIdx.x < p.num_out_rows) {
    const int64_t o = row0 + threadIdx.x;
    const int64_t tail = clamp_val<int64_t>(qsl[b], 0, p.num_target_tokens) + static_cast<int64_t>(b) * n_new;
    DraftRow row{kInertTokenId, 0, false, false, kPaddingSlotId};
    int64_t src = -1;
    if (o < tail && b > 0) {
      const int32_t r = find_request(qsl, b, p.num_target_tokens, n_new, o);
      const DraftRequestPlan plan = plan_draft_request(p, r);
      const int32_t j = static_cast<int32_t>(o - plan.out0);
      if (j >= 0 && j < plan.rows) {
        row = draft_row(p, plan, r, j);
        if (!plan.padding && j >= plan.nv && j < plan.nv + p.num_slots)
          p.token_indices_to_sample[static_cast<int64_t>(r) * p.num_slots + (j - plan.nv)] =
              static_cast<int32_t>(o);
        if (p.hidden_row_bytes > 0) src = hidden_source(plan, row, j);
      }
    }
    p.input_ids[o] = row.token_id;
    p.positions[o] = row.position;
    p.is_rejected[o] = row.rejected;
    p.is_masked[o] = row.masked;
    p.slot_mapping[o] = row.slot;
    if (src != -1) {
      const int k = atomicAdd(&s_num_copies, 1);
      s_dst[k] = o;
      s_src[k] = src;
    }
  }
  if (p.hidden_row_bytes == 0) return;
  __syncthreads();
  const int n = s_num_copies;
  if (n == 0) return;
  if constexpr (kVecBytes == 16) {
    copy_rows<uint4>(p, s_dst, s_src, n);
  } else if constexpr (kVecBytes == 8) {
    copy_rows<uint2>(p, s_dst, s_src, n);
  } else if constexpr (kVecBytes == 4) {
    copy_rows<uint32_t>(p, s_dst, s_src, n);
  } else if constexpr (kVecBytes == 2) {
    copy_rows<uint16_t>(p, s_dst, s_src, n);
  } else {
    copy_rows<uint8_t>(p, s_dst, s_src, n);
  }
}

__global__ void prepare_next_token_ids_kernel(const int32_t* sampled, int64_t stride, int32_t cols,
                                              const bool* discard, const int32_t* backup,
                                              int32_t vocab, int32_t b, int32_t* next,
                                              int32_t* valid) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= b) return;
  next_token_for_request(sampled + r * stride, cols, discard[r], backup[r], vocab, next + r, valid + r);
}

// Widest vector width (bytes) that divides every hidden address and stride.
int hidden_vec_bytes(const PrepareDraftInputsParams& p) {
  const uint64_t bits = static_cast<uint64_t>(p.hidden_row_bytes) |
                        static_cast<uint64_t>(p.target_hidden_stride) |
                        static_cast<uint64_t>(p.hidden_stride) |
                        reinterpret_cast<uintptr_t>(p.target_hidden) |
                        reinterpret_cast<uintptr_t>(p.mask_hidden) |
                        reinterpret_cast<uintptr_t>(p.hidden_states);
  for (int w = 16; w > 1; w >>= 1)
    if ((bits & (w - 1)) == 0) return w;
  return 1;
}

}  // namespace

cudaError_t launch_prepare_draft_inputs(const PrepareDraftInputsParams& p, cudaStream_t stream) {
  // Rows per block: enough blocks to cover the SMs a few times when hidden rows are copied
  // (bandwidth), otherwise the maximum (latency: fewer blocks, same single pass).
  int rows_per_block = kMaxRowsPerBlock;
  if (p.hidden_row_bytes > 0) {
    const int64_t row_bytes = p.hidden_row_bytes;
    // ~32 KB of hidden bytes per block keeps 256 threads busy with 8 16-byte vectors each.
    int64_t r = (32 * 1024) / (row_bytes > 0 ? row_bytes : 1);
    rows_per_block = static_cast<int>(clamp_val<int64_t>(r, 1, kMaxRowsPerBlock));
  }
  const int64_t row_blocks = (p.num_out_rows + rows_per_block - 1) / rows_per_block;
  const int64_t req_blocks = (static_cast<int64_t>(p.num_reqs) + kThreads) / kThreads;
  const int64_t grid = row_blocks > req_blocks ? row_blocks : req_blocks;
  const size_t smem = (p.num_reqs + 1 <= kSmemQslEntries ? p.num_reqs + 1 : 0) * sizeof(int32_t);
  const int vec = p.hidden_row_bytes > 0 ? hidden_vec_bytes(p) : 16;
  switch (vec) {
    case 16: prepare_draft_inputs_kernel<16><<<grid, kThreads, smem, stream>>>(p, rows_per_block); break;
    case 8: prepare_draft_inputs_kernel<8><<<grid, kThreads, smem, stream>>>(p, rows_per_block); break;
    case 4: prepare_draft_inputs_kernel<4><<<grid, kThreads, smem, stream>>>(p, rows_per_block); break;
    case 2: prepare_draft_inputs_kernel<2><<<grid, kThreads, smem, stream>>>(p, rows_per_block); break;
    default: prepare_draft_inputs_kernel<1><<<grid, kThreads, smem, stream>>>(p, rows_per_block); break;
  }
  return cudaGetLastError();
}

cudaError_t launch_prepare_next_token_ids(const int32_t* sampled_token_ids, int64_t sampled_stride,
                                          int32_t num_cols, const bool* discard_request_mask,
                                          const int32_t* backup_next_token_ids, int32_t vocab_size,
                                          int32_t num_reqs, int32_t* next_token_ids,
                                          int32_t* valid_sampled_tokens_count, cudaStream_t stream) {
  if (num_reqs == 0) return cudaSuccess;
  const int threads = 128;
  const int blocks = (num_reqs + threads - 1) / threads;
  prepare_next_token_ids_kernel<<<blocks, threads, 0, stream>>>(
      sampled_token_ids, sampled_stride, num_cols, discard_request_mask, backup_next_token_ids,
      vocab_size, num_reqs, next_token_ids, valid_sampled_tokens_count);
  return cudaGetLastError();
}

}  // namespace peagle
