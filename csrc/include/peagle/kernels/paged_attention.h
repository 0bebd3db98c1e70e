// paged_attention: causal (bottom-right) attention of ragged query rows over a paged KV cache
// (SPEC.md §5), torch-free.
//
// Request r owns query rows [query_start_loc[r], query_start_loc[r+1]) and kv_len = seq_lens[r]
// keys (this step's rows included). Row i (0-based within the request) of a request with q_len
// rows sees the keys k with
//     lo(i) <= k <= hi(i),  hi(i) = kv_len - q_len + i,
//     lo(i) = max(0, hi(i) - window_left)   (window_left < 0: lo(i) = 0),
// and, on the device, k < max_blocks_per_seq * block_size (keys past the block table's capacity
// are invisible; the CPU op raises instead). Query head h reads KV head h / (Hq / Hkv). Scores
// are softmax_scale * q.k in fp32; sinks[h] (optional) is one more logit in the softmax
// denominator that carries no value. lse = natural-log log-sum-exp of the scaled scores (and the
// sink). A row that sees no key writes 0 and lse = -inf (sinks[h] with a sink).
//
// The CPU loop (csrc/cpu/paged_attention.cpp) and the CUDA kernels
// (csrc/cuda/paged_attention.cu) share the request/row helpers below.
#pragma once
#include <cstdint>

#include "peagle/common.h"

namespace peagle {

enum class AttnDtype : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct PagedAttentionParams {
  // [T, Hq, D], unit stride in D; strides in elements.
  const void* query = nullptr;
  int64_t q_stride_t = 0, q_stride_h = 0;
  // [num_blocks, block_size, Hkv, D] each, unit stride in D (strided views allowed).
  const void* key_cache = nullptr;
  const void* value_cache = nullptr;
  int64_t k_stride_block = 0, k_stride_slot = 0, k_stride_head = 0;
  int64_t v_stride_block = 0, v_stride_slot = 0, v_stride_head = 0;
  int64_t num_blocks = 0;
  int32_t block_size = 0;  // a power of two
  int32_t log2_block_size = 0;
  // [B, max_blocks_per_seq] int32, unit stride in the column dimension.
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  int32_t max_blocks_per_seq = 0;
  const int32_t* query_start_loc = nullptr;  // [B + 1]
  const int32_t* seq_lens = nullptr;         // [B]
  // Outputs: out [T, Hq, D] (unit stride in D), lse [T, Hq] fp32 (unit stride in Hq) or null.
  void* out = nullptr;
  int64_t o_stride_t = 0, o_stride_h = 0;
  float* lse = nullptr;
  int64_t lse_stride_t = 0;
  const float* sinks = nullptr;  // [Hq] or null
  // Sizes and scalars.
  int32_t num_reqs = 0;
  int64_t num_tokens = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  float softmax_scale = 1.f;
  int32_t window_left = -1;   // < 0: no sliding window
  int32_t max_query_len = 0;  // launch hint only (CUDA); results never depend on it
  int32_t num_splits = 0;     // 0: chosen on the device; > 0: fixed
  AttnDtype dtype = AttnDtype::kBFloat16;
  // CUDA only: split-KV workspace (fp32 partial outputs [plan.ws_partials, T, Hq, D] and their
  // lse [plan.ws_partials, T, Hq], lse in the log2 domain), the cluster merge's arrival counters
  // ([T * Hq] uint32, zero before the launch and zero again after it), the device's SM count and
  // compute capability (major * 10 + minor); set by the glue (sizes from plan_paged_attention).
  float* ws_out = nullptr;
  float* ws_lse = nullptr;
  uint32_t* ws_counters = nullptr;
  int32_t max_splits = 1;
  int32_t num_sms = 0;
  int32_t arch = 0;
  // 0: the plan picks the split merge (the merge kernel unless PEAGLE_ATTN_MERGE=cluster selects
  // the in-kernel cluster merge on sm_90+); 1: always the merge kernel. Never changes which keys a
  // row sees.
  int32_t merge_mode = 0;
};

// Query rows and KV length of request r, clamped so that no access leaves its array (the CPU op
// reports inconsistent values as errors before getting here).
struct AttnRequest {
  int64_t q_start;  // first query row
  int32_t q_len;    // query rows (0: padding request, reads nothing)
  int32_t kv_len;   // keys (0: reads nothing)
};

PEAGLE_HD AttnRequest attn_request(const int32_t* query_start_loc, const int32_t* seq_lens,
                                   int64_t num_tokens, int32_t r) {
  AttnRequest a;
  const int64_t qs = clamp_val<int64_t>(query_start_loc[r], 0, num_tokens);
  const int64_t qe = clamp_val<int64_t>(query_start_loc[r + 1], qs, num_tokens);
  a.q_start = qs;
  a.q_len = static_cast<int32_t>(qe - qs);
  a.kv_len = seq_lens[r] > 0 ? seq_lens[r] : 0;
  return a;
}

// Last visible key of row i (may be negative: the row sees nothing).
PEAGLE_HD int64_t attn_row_key_hi(int32_t kv_len, int32_t q_len, int64_t i) {
  return static_cast<int64_t>(kv_len) - q_len + i;
}

// First visible key of row i.
PEAGLE_HD int64_t attn_row_key_lo(int32_t kv_len, int32_t q_len, int64_t i, int32_t window_left) {
  if (window_left < 0) return 0;
  const int64_t lo = attn_row_key_hi(kv_len, q_len, i) - window_left;
  return lo > 0 ? lo : 0;
}

// CUDA: B * Hkv * num_splits must not exceed this (1-D grid of the main kernel, < 2^31).
constexpr int64_t kPagedAttentionGridLimit = INT32_MAX - 64;

// Keys a request may address through its block table: max_blocks_per_seq * block_size.
PEAGLE_HD int64_t attn_key_capacity(const PagedAttentionParams& p) {
  return static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size;
}

}  // namespace peagle

#if defined(PEAGLE_WITH_CUDA) || defined(__CUDACC__)
#include <cuda_runtime_api.h>
namespace peagle {

// Launch configuration chosen on the host from host-known sizes only (B, Hkv, Hq/Hkv, head_dim,
// max_query_len hint, SM count, compute capability, PEAGLE_ATTN_IMPL): never from device data,
// so it is CUDA-graph safe. The kernel variant (impl, block_m, block_n) never depends on the
// max_query_len hint, so a fixed num_splits gives bit-identical results for any hint.
struct PagedAttentionPlan {
  int32_t block_m = 0;          // packed (query row x head) rows per CTA tile
  int32_t block_n = 64;         // keys per KV tile
  int32_t impl = 0;             // tensor-core path: 0 mma.sync (portable), 1 wgmma (sm_90a)
  int32_t q_tile_ctas = 0;      // CTAs along the packed-row axis per (request, KV head)
  int32_t max_splits = 1;       // KV splits per (request, KV head, q tile) at most
  bool one_cta_per_sm = false;  // automatic splits sized for one CTA per SM (single_cta_splits)
  // Split merge. cluster == 1: splits write fp32 partials (ws_partials = max_splits slots) and a
  // merge kernel combines them. cluster > 1 (sm_90+): the splits of a tile run as thread-block
  // clusters of `cluster` CTAs (cluster_count per tile, cluster * cluster_count >= max_splits)
  // that merge through distributed shared memory; with cluster_count > 1 every cluster writes one
  // fp32 partial per row slice (ws_partials = cluster_count slots) and the last cluster to arrive
  // at a slice (arrival counter, reset by it) merges them. No merge kernel either way.
  int32_t cluster = 1;
  int32_t cluster_count = 1;
  int32_t ws_partials = 0;       // partial slots of ws_out / ws_lse (0: no workspace)
  bool needs_workspace = false;  // ws_partials > 0: allocate ws_out / ws_lse
  bool needs_counters = false;   // allocate ws_counters ([T * Hq] uint32, kept zeroed)
  int32_t inert_ctas = 1;        // trailing CTAs that write the rows outside every request
  int64_t grid_ctas = 0;         // CTAs of the main kernel: B * Hkv * q_tiles * splits + inert
};

// Fills the plan; p.num_sms must be set. Never fails (unsupported shapes are rejected by the
// bind checks before this is called).
PagedAttentionPlan plan_paged_attention(const PagedAttentionParams& p);

// Main kernel (+ split merge when plan.max_splits > 1); no host sync, CUDA-graph safe.
// p.ws_out / p.ws_lse must hold [plan.ws_partials, T, Hq, D] / [plan.ws_partials, T, Hq] fp32 when
// plan.needs_workspace; p.ws_counters T * Hq zeroed uint32 when plan.needs_counters (the launch
// leaves them zeroed; two launches in flight at once must not share them).
cudaError_t launch_paged_attention(const PagedAttentionParams& p, const PagedAttentionPlan& plan,
                                   cudaStream_t stream);

}  // namespace peagle
#endif
