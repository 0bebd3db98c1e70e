// CUDA prepare_draft_inputs: the whole P-EAGLE draft-batch step in ONE launch (torch-free).
//
// Work is split by drafter output row, not by request, so ragged batches (long prefills next
// to decodes) stay balanced: block b owns rows [b*R, (b+1)*R), R <= 32. Latency matters more
// than bandwidth for small batches (the op is a chain of dependent loads), so each block
//   1. stages the target query_start_loc in shared memory;
//   2. (one thread per row) finds the owning request by binary search and computes its Stage
//      A/B plan with every request-level load issued at once; the row's hidden source (target
//      row or mask vector) follows from the plan alone and goes to shared memory;
//   3. splits: warp 0 finishes the rows (position -> block table -> slot; ids; flags; sample
//      indices) while warps 1..7 copy the hidden rows (16-byte vectors when every address and
//      stride is 16-byte aligned, narrower otherwise), so the two dependent chains overlap.
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

// Copies `rows` hidden rows (dst_row[i] <- src_row[i]; src -2 = the mask vector) with the
// threads [first_thread, kThreads) of the block.
template <typename Vec>
__device__ __forceinline__ void copy_rows(const PrepareDraftInputsParams& p, const int64_t* dst_row,
                                          const int64_t* src_row, int rows, int first_thread) {
  // rows <= kMaxRowsPerBlock and a row is < 2^31 bytes, so 32-bit indices suffice.
  const uint32_t n_vec = static_cast<uint32_t>(p.hidden_row_bytes / static_cast<int64_t>(sizeof(Vec)));
  const uint32_t total = n_vec * static_cast<uint32_t>(rows);
  const uint32_t stride = kThreads - first_thread;
  // Unrolled by 4 so that several independent loads are in flight per thread.
  for (uint32_t base = threadIdx.x - first_thread; base < total; base += 4 * stride) {
    Vec v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const uint32_t idx = base + u * stride;
      if (idx < total) {
        const uint32_t i = idx / n_vec;
        const int64_t src = src_row[i];
        const Vec* s = src == -2 ? reinterpret_cast<const Vec*>(p.mask_hidden)
                                 : reinterpret_cast<const Vec*>(p.target_hidden + src * p.target_hidden_stride);
        v[u] = s[idx - i * n_vec];
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const uint32_t idx = base + u * stride;
      if (idx < total) {
        const uint32_t i = idx / n_vec;
        reinterpret_cast<Vec*>(p.hidden_states + dst_row[i] * p.hidden_stride)[idx - i * n_vec] = v[u];
      }
    }
  }
}

template <int kVecBytes>
__device__ __forceinline__ void copy_hidden(const PrepareDraftInputsParams& p, const int64_t* dst,
                                            const int64_t* src, int rows, int first_thread) {
  if constexpr (kVecBytes == 16) {
    copy_rows<uint4>(p, dst, src, rows, first_thread);
  } else if constexpr (kVecBytes == 8) {
    copy_rows<uint2>(p, dst, src, rows, first_thread);
  } else if constexpr (kVecBytes == 4) {
    copy_rows<uint32_t>(p, dst, src, rows, first_thread);
  } else if constexpr (kVecBytes == 2) {
    copy_rows<uint16_t>(p, dst, src, rows, first_thread);
  } else {
    copy_rows<uint8_t>(p, dst, src, rows, first_thread);
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
  __syncthreads();
  const int32_t* qsl = qsl_in_smem ? smem_qsl : p.query_start_loc;

  // Phase 2: owning request, plan, hidden source of each row (warp 0, one thread per row).
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t o = row0 + threadIdx.x;
  const bool row_thread = threadIdx.x < rows_per_block && o < p.num_out_rows;
  const int64_t tail =
      clamp_val<int64_t>(qsl[b], 0, p.num_target_tokens) + static_cast<int64_t>(b) * n_new;
  DraftRequestPlan plan;
  int32_t r = 0, j = -1;
  if (row_thread && o < tail && b > 0) {
    r = find_request(qsl, b, p.num_target_tokens, n_new, o);
    plan = plan_draft_request(p, r);
    j = static_cast<int32_t>(o - plan.out0);
    if (j >= plan.rows) j = -1;
    if (j >= 0 && p.hidden_row_bytes > 0) {
      const int64_t src = hidden_source(plan, p.num_slots, j);
      if (src != -1) {
        const int k = atomicAdd(&s_num_copies, 1);
        s_dst[k] = o;
        s_src[k] = src;
      }
    }
  }
  if (p.hidden_row_bytes > 0) __syncthreads();

  // Phase 3: warp 0 finishes the rows; the other warps copy hidden rows meanwhile.
  if (threadIdx.x < 32) {
    if (row_thread) {
      DraftRow row{kInertTokenId, 0, false, false, kPaddingSlotId};
      if (j >= 0) {
        plan.p0 = first_position(p, plan);
        row = draft_row(p, plan, r, j);
        if (!plan.padding && j >= plan.nv && j < plan.nv + p.num_slots)
          p.token_indices_to_sample[static_cast<int64_t>(r) * p.num_slots + (j - plan.nv)] =
              static_cast<int32_t>(o);
      }
      p.input_ids[o] = row.token_id;
      p.positions[o] = row.position;
      p.is_rejected[o] = row.rejected;
      p.is_masked[o] = row.masked;
      p.slot_mapping[o] = row.slot;
    }
  } else if (p.hidden_row_bytes > 0 && s_num_copies > 0) {
    copy_hidden<kVecBytes>(p, s_dst, s_src, s_num_copies, 32);
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

cudaError_t launch_prepare_next_token_ids(const NextTokenParams& p, cudaStream_t stream) {
  if (p.num_reqs == 0) return cudaSuccess;
  const int threads = 128;
  const int blocks = (p.num_reqs + threads - 1) / threads;
  prepare_next_token_ids_kernel<<<blocks, threads, 0, stream>>>(
      p.sampled_token_ids, p.sampled_stride, p.num_cols, p.discard_request_mask,
      p.backup_next_token_ids, p.vocab_size, p.num_reqs, p.next_token_ids,
      p.valid_sampled_tokens_count);
  return cudaGetLastError();
}

}  // namespace peagle
