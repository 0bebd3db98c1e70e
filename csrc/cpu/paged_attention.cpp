// CPU implementation of paged_attention (SPEC.md §5), the CI oracle of the CUDA kernel.
//
// Work item = (request, KV head): the request's visible keys are gathered from the paged cache
// once into fp32 (each page read once for the whole GQA group and all query rows), then every
// (query row, head) of the group runs an fp32 softmax over its causal/window range. Unlike the
// CUDA path, this op checks the metadata values and raises on bad ones: query_start_loc not
// non-decreasing or past T, negative seq_lens, a request whose ceil(kv_len / block_size) exceeds
// the block table's width (EDGE_CASES B1), or a negative / out-of-range block id in a column the
// request needs. Padding requests (q_len == 0) and kv_len == 0 requests never read the table.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "peagle/backends.h"
#include "peagle/torch_checks.h"

namespace peagle {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// First key a request needs (the first row's window start) and its block-table columns.
int64_t first_needed_key(const PagedAttentionParams& p, const AttnRequest& a) {
  return attn_row_key_lo(a.kv_len, a.q_len, 0, p.window_left);
}

void check_values(const PagedAttentionParams& p) {
  const int32_t* qsl = p.query_start_loc;
  if (p.num_reqs == 0) return;
  TORCH_CHECK(qsl[0] >= 0, "peagle: paged_attention: query_start_loc[0] must be >= 0, got ",
              qsl[0]);
  for (int32_t r = 0; r < p.num_reqs; ++r) {
    TORCH_CHECK(qsl[r + 1] >= qsl[r],
                "peagle: paged_attention: query_start_loc must be "
                "non-decreasing, got [",
                r, "]=", qsl[r], " > [", r + 1, "]=", qsl[r + 1]);
    TORCH_CHECK(p.seq_lens[r] >= 0, "peagle: paged_attention: seq_lens[", r, "] = ", p.seq_lens[r],
                " is negative");
  }
  TORCH_CHECK(qsl[p.num_reqs] <= p.num_tokens,
              "peagle: paged_attention: query_start_loc[B] = ", qsl[p.num_reqs],
              " exceeds the T = ", p.num_tokens, " query rows");
  for (int32_t r = 0; r < p.num_reqs; ++r) {
    const AttnRequest a = attn_request(qsl, p.seq_lens, p.num_tokens, r);
    if (a.q_len == 0 || a.kv_len == 0) continue;  // reads no pages
    const int64_t needed_cols = (static_cast<int64_t>(a.kv_len) + p.block_size - 1) / p.block_size;
    TORCH_CHECK(needed_cols <= p.max_blocks_per_seq, "peagle: paged_attention: request ", r,
                " has seq_len ", a.kv_len, ", which needs ceil(", a.kv_len, " / block_size ",
                p.block_size, ") = ", needed_cols, " block-table columns, but block_table has ",
                p.max_blocks_per_seq, " (capacity ", attn_key_capacity(p), " keys)");
    const int32_t* row = p.block_table + r * p.block_table_stride;
    for (int64_t c = first_needed_key(p, a) / p.block_size; c < needed_cols; ++c) {
      TORCH_CHECK(row[c] >= 0 && row[c] < p.num_blocks, "peagle: paged_attention: request ", r,
                  " needs block_table[", r, ", ", c, "] = ", row[c],
                  ", which is not a block of the cache [0, ", p.num_blocks, ")");
    }
  }
}

template <typename T>
void write_row(T* o, int32_t d, const float* acc, float inv) {
  for (int32_t j = 0; j < d; ++j) o[j] = static_cast<T>(acc[j] * inv);
}

template <typename T>
void zero_row(T* o, int32_t d) {
  for (int32_t j = 0; j < d; ++j) o[j] = static_cast<T>(0.f);
}

template <typename T>
void run_paged_attention_cpu(const PagedAttentionParams& p) {
  const int32_t d = p.head_dim;
  const int32_t group = p.num_q_heads / p.num_kv_heads;
  const T* q = static_cast<const T*>(p.query);
  const T* kc = static_cast<const T*>(p.key_cache);
  const T* vc = static_cast<const T*>(p.value_cache);
  T* out = static_cast<T*>(p.out);

  auto empty_row = [&](int64_t t, int32_t h) {
    zero_row(out + t * p.o_stride_t + h * p.o_stride_h, d);
    if (p.lse) p.lse[t * p.lse_stride_t + h] = p.sinks ? p.sinks[h] : kNegInf;
  };

  // Rows outside every request (a padded tail) are written inert: 0 and lse -inf.
  const int64_t covered_lo = p.num_reqs > 0 ? p.query_start_loc[0] : 0;
  const int64_t covered_hi = p.num_reqs > 0 ? p.query_start_loc[p.num_reqs] : 0;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    if (t >= covered_lo && t < covered_hi) continue;
    for (int32_t h = 0; h < p.num_q_heads; ++h) {
      zero_row(out + t * p.o_stride_t + h * p.o_stride_h, d);
      if (p.lse) p.lse[t * p.lse_stride_t + h] = kNegInf;
    }
  }

  const int64_t work = static_cast<int64_t>(p.num_reqs) * p.num_kv_heads;
  at::parallel_for(0, work, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> keys, values, scores, acc(d), qrow(d);
    for (int64_t w = begin; w < end; ++w) {
      const int32_t r = static_cast<int32_t>(w / p.num_kv_heads);
      const int32_t g = static_cast<int32_t>(w % p.num_kv_heads);
      const AttnRequest a = attn_request(p.query_start_loc, p.seq_lens, p.num_tokens, r);
      if (a.q_len == 0) continue;  // padding request: no rows, no table reads
      // Keys any row of the request sees: [k0, kv_len).
      const int64_t k0 = a.kv_len > 0 ? first_needed_key(p, a) : 0;
      const int64_t nk = a.kv_len > 0 ? a.kv_len - k0 : 0;
      keys.resize(nk * d);
      values.resize(nk * d);
      const int32_t* table = p.block_table + r * p.block_table_stride;
      for (int64_t k = 0; k < nk; ++k) {
        const int64_t key = k0 + k;
        const int64_t blk = table[key >> p.log2_block_size];
        const int64_t off = key & (p.block_size - 1);
        const T* ks = kc + blk * p.k_stride_block + off * p.k_stride_slot + g * p.k_stride_head;
        const T* vs = vc + blk * p.v_stride_block + off * p.v_stride_slot + g * p.v_stride_head;
        for (int32_t j = 0; j < d; ++j) {
          keys[k * d + j] = static_cast<float>(ks[j]);
          values[k * d + j] = static_cast<float>(vs[j]);
        }
      }
      scores.resize(std::max<int64_t>(nk, 1));
      for (int32_t hh = 0; hh < group; ++hh) {
        const int32_t h = g * group + hh;
        const bool has_sink = p.sinks != nullptr;
        const float sink = has_sink ? p.sinks[h] : kNegInf;
        for (int32_t i = 0; i < a.q_len; ++i) {
          const int64_t t = a.q_start + i;
          const int64_t hi = attn_row_key_hi(a.kv_len, a.q_len, i);
          const int64_t lo = attn_row_key_lo(a.kv_len, a.q_len, i, p.window_left);
          if (hi < lo) {
            empty_row(t, h);
            continue;
          }
          const T* qs = q + t * p.q_stride_t + h * p.q_stride_h;
          for (int32_t j = 0; j < d; ++j) qrow[j] = static_cast<float>(qs[j]);
          float m = sink;
          for (int64_t k = lo; k <= hi; ++k) {
            const float* kr = keys.data() + (k - k0) * d;
            float s = 0.f;
            for (int32_t j = 0; j < d; ++j) s += qrow[j] * kr[j];
            s *= p.softmax_scale;
            scores[k - lo] = s;
            m = std::max(m, s);
          }
          std::fill(acc.begin(), acc.end(), 0.f);
          float sum = has_sink ? std::exp(sink - m) : 0.f;
          for (int64_t k = lo; k <= hi; ++k) {
            const float e = std::exp(scores[k - lo] - m);
            sum += e;
            const float* vr = values.data() + (k - k0) * d;
            for (int32_t j = 0; j < d; ++j) acc[j] += e * vr[j];
          }
          write_row(out + t * p.o_stride_t + h * p.o_stride_h, d, acc.data(), 1.f / sum);
          if (p.lse) p.lse[t * p.lse_stride_t + h] = m + std::log(sum);
        }
      }
    }
  });
}

}  // namespace

void paged_attention_cpu(const PagedAttentionParams& p) {
  if (p.num_tokens == 0) return;  // B == 0 or T == 0 (EDGE_CASES B2)
  check_values(p);
  switch (p.dtype) {
    case AttnDtype::kFloat32:
      run_paged_attention_cpu<float>(p);
      break;
    case AttnDtype::kFloat16:
      run_paged_attention_cpu<c10::Half>(p);
      break;
    case AttnDtype::kBFloat16:
      run_paged_attention_cpu<c10::BFloat16>(p);
      break;
  }
}

}  // namespace peagle
