// paged_attention: the op's one torch-facing entry (schema in csrc/registration.cpp). Tensors ->
// PagedAttentionParams with every shape/dtype/device check, then the CPU kernel
// (csrc/cpu/paged_attention.cpp, which also checks values: query_start_loc order, block ids,
// capacity) or the CUDA launcher (csrc/cuda/paged_attention_glue.cpp) on the params. The caches
// are never copied: strided views are read through their strides.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "peagle/backends.h"
#include "peagle/torch_checks.h"

namespace peagle {

// Largest accepted num_splits (the CUDA kernel clamps the effective split count per request to
// its number of 64-key tiles).
constexpr int64_t kPagedAttentionMaxSplits = 256;

struct BoundPagedAttention {
  PagedAttentionParams params;
  std::vector<at::Tensor> keep_alive;  // contiguous copies of small strided metadata
};

inline AttnDtype attn_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return AttnDtype::kFloat32;
    case at::kHalf:
      return AttnDtype::kFloat16;
    default:
      return AttnDtype::kBFloat16;
  }
}

void paged_attention(const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_table,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     double softmax_scale, int64_t max_query_len, const at::Tensor& out,
                     const c10::optional<at::Tensor>& lse, int64_t window_left,
                     const c10::optional<at::Tensor>& sinks, int64_t num_splits) {
  BoundPagedAttention bound;
  auto& p = bound.params;
  const bool cuda = query.is_cuda();
  auto in = [&](const at::Tensor& t) -> at::Tensor {
    at::Tensor c = t.contiguous();
    bound.keep_alive.push_back(c);
    return c;
  };

  // query [T, Hq, D]
  const at::ScalarType dt = query.scalar_type();
  if (cuda) {
    TORCH_CHECK(dt == at::kHalf || dt == at::kBFloat16,
                "peagle: paged_attention on CUDA needs query of dtype bfloat16 or float16, got ",
                dt);
  } else {
    TORCH_CHECK(is_float_dtype(dt),
                "peagle: paged_attention needs query of dtype bfloat16/float16 (float32 on CPU "
                "only), got ",
                dt);
  }
  check_dim(query, "query", 3);
  const int64_t t = query.size(0), hq = query.size(1), d = query.size(2);
  TORCH_CHECK(hq >= 1 && d >= 1, "peagle: query must have Hq >= 1 and D >= 1, got shape ",
              shape_str(query));
  if (cuda) {
    TORCH_CHECK(d == 64 || d == 128,
                "peagle: paged_attention on CUDA supports head_dim 64 and 128, "
                "got query of shape ",
                shape_str(query), " (head_dim ", d, ")");
  }
  check_rows_contiguous(query, "query");

  // key_cache / value_cache [num_blocks, block_size, Hkv, D]
  check_dim(key_cache, "key_cache", 4);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1),
                hkv = key_cache.size(2);
  TORCH_CHECK(hkv >= 1 && hq % hkv == 0, "peagle: query heads Hq=", hq,
              " must be a multiple of the cache's KV heads Hkv=", hkv, " (key_cache shape ",
              shape_str(key_cache), ")");
  const bool pow2 = block_size >= 1 && (block_size & (block_size - 1)) == 0;
  const int64_t min_block = cuda ? 8 : 1;
  TORCH_CHECK(pow2 && block_size >= min_block && block_size <= (1 << 20),
              "peagle: block_size (key_cache.size(1)) must be a power of two >= ", min_block,
              cuda ? " on CUDA" : "", ", got key_cache of shape ", shape_str(key_cache));
  for (auto [c, name] :
       {std::pair{&key_cache, "key_cache"}, std::pair{&value_cache, "value_cache"}}) {
    check_dtype(*c, name, dt);
    check_shape(*c, name, {num_blocks, block_size, hkv, d});
    check_rows_contiguous(*c, name);
    check_device(*c, name, query, "query");
  }

  // Metadata.
  check_dtype(query_start_loc, "query_start_loc", at::kInt);
  check_dim(query_start_loc, "query_start_loc", 1);
  TORCH_CHECK(query_start_loc.size(0) >= 1, "peagle: query_start_loc must have B+1 >= 1 entries");
  const int64_t b = query_start_loc.size(0) - 1;
  check_dtype(seq_lens, "seq_lens", at::kInt);
  check_shape(seq_lens, "seq_lens", {b});
  check_dtype(block_table, "block_table", at::kInt);
  check_dim(block_table, "block_table", 2);
  TORCH_CHECK(block_table.size(0) == b, "peagle: block_table must have B=", b,
              " rows (query_start_loc has B+1 entries), got shape ", shape_str(block_table));
  for (auto [x, name] :
       {std::pair{&query_start_loc, "query_start_loc"}, std::pair{&seq_lens, "seq_lens"},
        std::pair{&block_table, "block_table"}}) {
    check_device(*x, name, query, "query");
  }

  // Outputs.
  check_dtype(out, "out", dt);
  check_shape(out, "out", {t, hq, d});
  check_rows_contiguous(out, "out");
  check_device(out, "out", query, "query");
  if (lse.has_value()) {
    check_dtype(*lse, "lse", at::kFloat);
    check_shape(*lse, "lse", {t, hq});
    TORCH_CHECK(lse->stride(1) == 1 || hq == 1,
                "peagle: lse must have unit stride in its head dimension, got strides ",
                c10::str(lse->strides()));
    check_device(*lse, "lse", query, "query");
  }
  if (sinks.has_value()) {
    check_dtype(*sinks, "sinks", at::kFloat);
    check_shape(*sinks, "sinks", {hq});
    check_device(*sinks, "sinks", query, "query");
  }

  // Scalars.
  TORCH_CHECK(std::isfinite(softmax_scale), "peagle: softmax_scale must be finite, got ",
              softmax_scale);
  TORCH_CHECK(max_query_len >= -1, "peagle: max_query_len must be -1 (= T) or >= 0, got ",
              max_query_len);
  TORCH_CHECK(num_splits >= 0 && num_splits <= kPagedAttentionMaxSplits,
              "peagle: num_splits must be 0 (automatic) or in [1, ", kPagedAttentionMaxSplits,
              "], got ", num_splits);
  TORCH_CHECK(t <= INT32_MAX && b <= INT32_MAX && hq <= INT32_MAX && d <= INT32_MAX &&
                  block_table.size(1) <= INT32_MAX,
              "peagle: paged_attention sizes must fit in int32");

  TORCH_CHECK(t * hq <= INT32_MAX, "peagle: paged_attention needs T * Hq < 2^31, got T=", t,
              " Hq=", hq);
  if (cuda) {
    // 16-byte cp.async rows: data pointers 16-byte aligned, strides multiples of 8 elements;
    // out is written as 2-element words. Cache strides are used as int32 by the kernel.
    auto aligned = [](const at::Tensor& x, int64_t bytes) {
      bool ok = reinterpret_cast<uintptr_t>(x.data_ptr()) % bytes == 0;
      for (int64_t i = 0; i + 1 < x.dim(); ++i) {
        ok = ok && (x.stride(i) * x.element_size()) % bytes == 0;
      }
      return ok;
    };
    for (auto [x, name] : {std::pair{&query, "query"}, std::pair{&key_cache, "key_cache"},
                           std::pair{&value_cache, "value_cache"}}) {
      TORCH_CHECK(aligned(*x, 16), "peagle: paged_attention on CUDA needs ", name,
                  " 16-byte aligned with strides that are multiples of 8 elements, got strides ",
                  c10::str(x->strides()));
    }
    TORCH_CHECK(aligned(out, 4),
                "peagle: paged_attention on CUDA needs out 4-byte aligned with "
                "even strides, got strides ",
                c10::str(out.strides()));
    // One CTA per (request, KV head, split) at least: a 1-D grid < 2^31.
    TORCH_CHECK(b * hkv * std::max<int64_t>(num_splits, 1) <= kPagedAttentionGridLimit,
                "peagle: paged_attention on CUDA needs B * Hkv * num_splits < 2^31 - 64, got B=", b,
                " Hkv=", hkv, " num_splits=", num_splits);
    for (auto* c : {&key_cache, &value_cache}) {
      for (int64_t i = 0; i < 3; ++i) {
        TORCH_CHECK(c->stride(i) >= 0 && c->stride(i) <= INT32_MAX,
                    "peagle: paged_attention on CUDA needs cache strides < 2^31, got ",
                    c10::str(c->strides()));
      }
    }
  }

  const at::Tensor bt =
      block_table.size(1) <= 1 || block_table.stride(1) == 1 ? block_table : in(block_table);
  p.query = query.data_ptr();
  p.q_stride_t = query.stride(0);
  p.q_stride_h = query.stride(1);
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.k_stride_block = key_cache.stride(0);
  p.k_stride_slot = key_cache.stride(1);
  p.k_stride_head = key_cache.stride(2);
  p.v_stride_block = value_cache.stride(0);
  p.v_stride_slot = value_cache.stride(1);
  p.v_stride_head = value_cache.stride(2);
  p.num_blocks = num_blocks;
  p.block_size = static_cast<int32_t>(block_size);
  int32_t log2_bs = 0;
  while ((int64_t{1} << log2_bs) < block_size) ++log2_bs;
  p.log2_block_size = log2_bs;
  p.block_table = bt.data_ptr<int32_t>();
  p.block_table_stride = bt.stride(0);
  p.max_blocks_per_seq = static_cast<int32_t>(bt.size(1));
  p.query_start_loc = in(query_start_loc).data_ptr<int32_t>();
  p.seq_lens = in(seq_lens).data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.o_stride_t = out.stride(0);
  p.o_stride_h = out.stride(1);
  if (lse.has_value()) {
    p.lse = lse->data_ptr<float>();
    p.lse_stride_t = lse->stride(0);
  }
  if (sinks.has_value()) p.sinks = in(*sinks).data_ptr<float>();
  p.num_reqs = static_cast<int32_t>(b);
  p.num_tokens = t;
  p.num_q_heads = static_cast<int32_t>(hq);
  p.num_kv_heads = static_cast<int32_t>(hkv);
  p.head_dim = static_cast<int32_t>(d);
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.window_left = window_left < 0
                      ? -1
                      : static_cast<int32_t>(window_left > INT32_MAX ? INT32_MAX : window_left);
  p.max_query_len =
      static_cast<int32_t>(max_query_len < 0 || max_query_len > t ? t : max_query_len);
  p.num_splits = static_cast<int32_t>(num_splits);
  p.dtype = attn_dtype(dt);
  PEAGLE_RUN(paged_attention, p, query);
}

PEAGLE_IMPL("paged_attention", &paged_attention);

}  // namespace peagle
