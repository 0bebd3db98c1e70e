// Microbenchmark of the drafter attention (launch_paged_attention) and the KV write
// (launch_write_kv_cache), torch-free. P-EAGLE decode batches: B requests x q_len query rows
// (14 = 2K, K = 7), each over kv keys of a paged bf16 cache (page 16, pages of every request
// scattered by a random permutation), causal bottom-right, heads Hq/Hkv x head_dim. The launch
// plan (tile, tensor-core path, KV splits, split workspace) is chosen by plan_paged_attention
// from host-known sizes, as the torch glue does. Prints µs per call (CUDA graph of one rotation
// through the input sets, and eager), GB/s and % of the copy ceiling measured in the same run:
//   attn:     GB/s on the KV bytes read (B * kv * Hkv * D * 2 tensors * 2 bytes);
//   write_kv: GB/s on the bytes read + written (B * q_len rows of K and V, twice).
// Inputs rotate through enough KV page sets (block tables into one shared cache) to touch >= 4x
// the L2 (cold L2). PEAGLE_ATTN_IMPL (mma, wgmma, ...-n32) forces a kernel variant.
//
// Before timing: B=2 (kv 100 / 37, q_len 14 / 9) for both head shapes, K/V written into a
// NaN-poisoned cache by write_kv_cache (plus a padding row), output and lse compared with an fp64
// host reference, with the automatic split count and with one split.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.h"
#include "peagle/kernels/paged_attention.h"
#include "peagle/kernels/write_kv_cache.h"

namespace {

const char* kUsage =
    "bench_paged_attention [--batch 1,8,64] [--kv 1024,4096,16384] [--heads 32/8x128,64/8x64]\n"
    "                      [--q-len 14] [--page 16] [--replays 100] [--json FILE] [--quick]\n"
    "  --heads: Hq/Hkv x head_dim (head_dim 64 or 128). --quick: 32/8x128, B 1,8, kv 1024,4096.\n";

struct Heads {
  int32_t hq, hkv, d;
};

bool parse_heads(const std::string& s, Heads& h) {
  return std::sscanf(s.c_str(), "%d/%dx%d", &h.hq, &h.hkv, &h.d) == 3 && h.hkv > 0 && h.hq > 0 &&
         h.hq % h.hkv == 0 && (h.d == 64 || h.d == 128);
}

std::string heads_name(const Heads& h) {
  return std::to_string(h.hq) + "/" + std::to_string(h.hkv) + "x" + std::to_string(h.d);
}

#define SANITY(cond, ...)                                        \
  do {                                                           \
    if (!(cond)) {                                               \
      std::fprintf(stderr, "sanity check failed: " __VA_ARGS__); \
      std::fprintf(stderr, "\n");                                \
      std::exit(1);                                              \
    }                                                            \
  } while (0)

// Paged bf16 caches [num_blocks, page, Hkv, D] (K and V), contiguous.
struct Cache {
  uint16_t* k = nullptr;
  uint16_t* v = nullptr;
  int64_t num_blocks = 0;
  int32_t page = 0;
  Heads h{};
  int64_t stride_block() const { return int64_t(page) * h.hkv * h.d; }
  size_t elems() const { return size_t(num_blocks) * stride_block(); }
};

// Params of one attention call over `c`; the caller sets the per-set pointers and the plan.
peagle::PagedAttentionParams attention_params(const Cache& c, int32_t b, int64_t t,
                                              int32_t max_blocks, int32_t max_q_len) {
  peagle::PagedAttentionParams p;
  p.q_stride_t = int64_t(c.h.hq) * c.h.d;
  p.q_stride_h = c.h.d;
  p.key_cache = c.k;
  p.value_cache = c.v;
  p.k_stride_block = p.v_stride_block = c.stride_block();
  p.k_stride_slot = p.v_stride_slot = int64_t(c.h.hkv) * c.h.d;
  p.k_stride_head = p.v_stride_head = c.h.d;
  p.num_blocks = c.num_blocks;
  p.block_size = c.page;
  while ((1 << p.log2_block_size) < c.page) ++p.log2_block_size;
  p.block_table_stride = max_blocks;
  p.max_blocks_per_seq = max_blocks;
  p.o_stride_t = p.q_stride_t;
  p.o_stride_h = p.q_stride_h;
  p.num_reqs = b;
  p.num_tokens = t;
  p.num_q_heads = c.h.hq;
  p.num_kv_heads = c.h.hkv;
  p.head_dim = c.h.d;
  p.softmax_scale = 1.0f / std::sqrt(float(c.h.d));
  p.max_query_len = max_q_len;
  p.dtype = peagle::AttnDtype::kBFloat16;
  int dev = 0;
  BENCH_CHECK(cudaGetDevice(&dev));
  int major = 0, minor = 0;
  BENCH_CHECK(cudaDeviceGetAttribute(&p.num_sms, cudaDevAttrMultiProcessorCount, dev));
  BENCH_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  BENCH_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  p.arch = major * 10 + minor;
  return p;
}

// Split-KV workspace for `plan` (as the glue allocates it); freed by the caller. The cluster
// merge's arrival counters (zeroed once, left zeroed by every launch) are one process-wide buffer
// that only grows, as the glue keeps one per stream.
std::pair<float*, float*> plan_workspace(peagle::PagedAttentionParams& p,
                                         const peagle::PagedAttentionPlan& plan) {
  if (plan.needs_counters) {
    static uint32_t* counters = nullptr;
    static size_t capacity = 0;
    const size_t n = size_t(p.num_tokens) * p.num_q_heads;
    if (n > capacity) {
      if (counters != nullptr) BENCH_CHECK(cudaFree(counters));
      counters = bench::device_alloc<uint32_t>(n);
      BENCH_CHECK(cudaMemset(counters, 0, n * sizeof(uint32_t)));
      capacity = n;
    }
    p.ws_counters = counters;
  }
  if (!plan.needs_workspace) return {nullptr, nullptr};
  const size_t rows = size_t(plan.ws_partials) * p.num_tokens * p.num_q_heads;
  p.ws_out = bench::device_alloc<float>(rows * p.head_dim);
  p.ws_lse = bench::device_alloc<float>(rows);
  p.max_splits = plan.max_splits;
  return {p.ws_out, p.ws_lse};
}

peagle::WriteKvCacheParams write_params(const Cache& c, const uint16_t* key, const uint16_t* value,
                                        const int64_t* slots, int64_t rows) {
  peagle::WriteKvCacheParams w;
  w.key = reinterpret_cast<const char*>(key);
  w.value = reinterpret_cast<const char*>(value);
  w.key_stride_t = w.value_stride_t = int64_t(c.h.hkv) * c.h.d;
  w.key_stride_h = w.value_stride_h = c.h.d;
  w.key_cache = reinterpret_cast<char*>(c.k);
  w.value_cache = reinterpret_cast<char*>(c.v);
  w.kc_stride_block = w.vc_stride_block = c.stride_block();
  w.kc_stride_slot = w.vc_stride_slot = int64_t(c.h.hkv) * c.h.d;
  w.kc_stride_head = w.vc_stride_head = c.h.d;
  w.slot_mapping = slots;
  w.num_tokens = rows;
  w.num_kv_heads = c.h.hkv;
  w.head_dim = c.h.d;
  w.elem_bytes = 2;
  w.num_blocks = c.num_blocks;
  w.block_size = c.page;
  return w;
}

std::vector<int32_t> random_permutation(int64_t n, bench::Rng& rng) {
  std::vector<int32_t> perm(n);
  for (int64_t i = 0; i < n; ++i) perm[i] = int32_t(i);
  for (int64_t i = n - 1; i > 0; --i) std::swap(perm[i], perm[rng.next() % (i + 1)]);
  return perm;
}

const char* impl_name(const peagle::PagedAttentionPlan& plan) {
  return plan.impl == 1 ? (plan.block_n == 32 ? "wgmma-n32" : "wgmma")
                        : (plan.block_n == 32 ? "mma-n32" : "mma");
}

// B=2 ragged (kv 100 / 37, q_len 14 / 9), page 16 in a shuffled, NaN-poisoned cache filled by
// write_kv_cache; out and lse vs an fp64 host reference; automatic splits and one split.
void sanity_check(const Heads& h, cudaStream_t stream) {
  const int32_t b = 2, page = 16, max_blocks = 8;
  const std::vector<int32_t> kv = {100, 37}, q_len = {14, 9};
  const int64_t t = q_len[0] + q_len[1], kv_rows = kv[0] + kv[1];
  Cache c;
  c.h = h;
  c.page = page;
  c.num_blocks = b * max_blocks + 3;
  c.k = bench::device_alloc<uint16_t>(c.elems());
  c.v = bench::device_alloc<uint16_t>(c.elems());
  BENCH_CHECK(cudaMemset(c.k, 0xff, c.elems() * 2));  // bf16 NaN in every unwritten slot
  BENCH_CHECK(cudaMemset(c.v, 0xff, c.elems() * 2));
  bench::Rng rng(7);
  const std::vector<int32_t> perm = random_permutation(c.num_blocks, rng);
  std::vector<int32_t> table(perm.begin(), perm.begin() + b * max_blocks);
  // K/V rows of both requests, then one padding row (slot -1) that must write nothing.
  const size_t row = size_t(h.hkv) * h.d;
  uint16_t* kin = bench::device_alloc<uint16_t>((kv_rows + 1) * row);
  uint16_t* vin = bench::device_alloc<uint16_t>((kv_rows + 1) * row);
  uint16_t* q = bench::device_alloc<uint16_t>(t * h.hq * h.d);
  bench::fill_normal_bf16(kin, (kv_rows + 1) * row, 1.0f, 1, stream);
  bench::fill_normal_bf16(vin, (kv_rows + 1) * row, 1.0f, 2, stream);
  bench::fill_normal_bf16(q, t * h.hq * h.d, 1.0f, 3, stream);
  std::vector<int64_t> slots;
  for (int32_t r = 0; r < b; ++r) {
    for (int32_t k = 0; k < kv[r]; ++k) {
      slots.push_back(int64_t(table[r * max_blocks + k / page]) * page + k % page);
    }
  }
  slots.push_back(peagle::kPaddingSlotId);
  int64_t* d_slots = bench::to_device(slots);
  BENCH_CHECK(
      peagle::launch_write_kv_cache(write_params(c, kin, vin, d_slots, kv_rows + 1), stream));
  const std::vector<uint16_t> host_k = bench::to_host(kin, kv_rows * row);
  const std::vector<uint16_t> host_v = bench::to_host(vin, kv_rows * row);
  const std::vector<uint16_t> host_q = bench::to_host(q, t * h.hq * h.d);

  peagle::PagedAttentionParams p = attention_params(c, b, t, max_blocks, q_len[0]);
  p.query = q;
  p.block_table = bench::to_device(table);
  p.query_start_loc = bench::to_device(std::vector<int32_t>{0, q_len[0], q_len[0] + q_len[1]});
  p.seq_lens = bench::to_device(kv);
  uint16_t* out = bench::device_alloc<uint16_t>(t * h.hq * h.d);
  p.out = out;
  p.lse = bench::device_alloc<float>(t * h.hq);
  p.lse_stride_t = h.hq;

  // fp64 reference.
  std::vector<double> ref_out(t * h.hq * h.d), ref_lse(t * h.hq);
  const int32_t group = h.hq / h.hkv;
  for (int32_t r = 0, q0 = 0, k0 = 0; r < b; q0 += q_len[r], k0 += kv[r], ++r) {
    for (int32_t i = 0; i < q_len[r]; ++i) {
      const int32_t hi = kv[r] - q_len[r] + i;
      for (int32_t hh = 0; hh < h.hq; ++hh) {
        const int32_t kh = hh / group;
        const uint16_t* qr = &host_q[(size_t(q0 + i) * h.hq + hh) * h.d];
        std::vector<double> s(hi + 1);
        double m = -INFINITY;
        for (int32_t k = 0; k <= hi; ++k) {
          const uint16_t* kr = &host_k[(size_t(k0 + k) * h.hkv + kh) * h.d];
          double dot = 0;
          for (int32_t e = 0; e < h.d; ++e) {
            dot += double(bench::bf16_to_float(qr[e])) * bench::bf16_to_float(kr[e]);
          }
          s[k] = dot * p.softmax_scale;
          m = std::max(m, s[k]);
        }
        double z = 0;
        for (double& x : s) z += (x = std::exp(x - m));
        double* o = &ref_out[(size_t(q0 + i) * h.hq + hh) * h.d];
        for (int32_t k = 0; k <= hi; ++k) {
          const uint16_t* vr = &host_v[(size_t(k0 + k) * h.hkv + kh) * h.d];
          for (int32_t e = 0; e < h.d; ++e) o[e] += s[k] / z * bench::bf16_to_float(vr[e]);
        }
        ref_lse[size_t(q0 + i) * h.hq + hh] = m + std::log(z);
      }
    }
  }
  const double out_tol = 2e-2, lse_tol = 2e-3;
  for (int32_t splits : {0, 1}) {
    p.num_splits = splits;
    p.max_splits = 1;
    p.ws_out = p.ws_lse = nullptr;
    const peagle::PagedAttentionPlan plan = peagle::plan_paged_attention(p);
    const auto ws = plan_workspace(p, plan);
    BENCH_CHECK(cudaMemset(out, 0xff, t * h.hq * h.d * 2));
    BENCH_CHECK(cudaMemset(p.lse, 0xff, t * h.hq * 4));
    BENCH_CHECK(peagle::launch_paged_attention(p, plan, stream));
    BENCH_CHECK(cudaStreamSynchronize(stream));
    const std::vector<uint16_t> got = bench::to_host(out, t * h.hq * h.d);
    const std::vector<float> lse = bench::to_host(p.lse, t * h.hq);
    double err = 0, lse_err = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double g = bench::bf16_to_float(got[i]);
      SANITY(std::isfinite(g), "%s: out[%zu] is not finite", heads_name(h).c_str(), i);
      err = std::max(err, std::fabs(g - ref_out[i]));
    }
    for (size_t i = 0; i < lse.size(); ++i) {
      SANITY(std::isfinite(lse[i]), "%s: lse[%zu] is not finite", heads_name(h).c_str(), i);
      lse_err = std::max(lse_err, std::fabs(lse[i] - ref_lse[i]));
    }
    SANITY(err <= out_tol && lse_err <= lse_tol,
           "%s splits=%d: max |out - ref| %.3g (bound %.3g), max |lse - ref| %.3g (bound %.3g)",
           heads_name(h).c_str(), plan.max_splits, err, out_tol, lse_err, lse_tol);
    std::printf(
        "sanity %-9s B=2 kv 100/37 q 14/9, %s, %2d split(s): max |out - ref| %.2e, "
        "max |lse - ref| %.2e\n",
        heads_name(h).c_str(), impl_name(plan), plan.max_splits, err, lse_err);
    BENCH_CHECK(cudaFree(ws.first));
    BENCH_CHECK(cudaFree(ws.second));
  }
  for (const void* ptr :
       {static_cast<const void*>(c.k), static_cast<const void*>(c.v), static_cast<const void*>(kin),
        static_cast<const void*>(vin), static_cast<const void*>(q),
        static_cast<const void*>(d_slots), static_cast<const void*>(p.block_table),
        static_cast<const void*>(p.query_start_loc), static_cast<const void*>(p.seq_lens),
        static_cast<const void*>(out), static_cast<const void*>(p.lse)}) {
    BENCH_CHECK(cudaFree(const_cast<void*>(ptr)));
  }
}

void print_row(const char* op, const Heads& h, int32_t b, int32_t kv, int n_sets, int splits,
               const char* impl, double graph, double eager, double gbps, double ceiling,
               bench::JsonLines& json, int32_t q_len, int32_t page) {
  std::printf("%-8s %-9s %4d %6d %5d %6d %-9s %9.2f %9.2f %8.0f %6.1f%%\n", op,
              heads_name(h).c_str(), b, kv, n_sets, splits, impl, graph, eager, gbps,
              100.0 * gbps / ceiling);
  json.row("\"op\":\"" + std::string(op) + "\",\"heads\":\"" + heads_name(h) +
               "\",\"B\":" + std::to_string(b) + ",\"kv\":" + std::to_string(kv) +
               ",\"q_len\":" + std::to_string(q_len) + ",\"page\":" + std::to_string(page) +
               ",\"input_sets\":" + std::to_string(n_sets) +
               ",\"splits\":" + std::to_string(splits) + ",\"impl\":\"" + impl + "\"",
           graph, eager, gbps);
}

// One shape: attention over kv keys per request; with `with_write`, also the KV write of this
// step's q_len rows per request into the same cache (timed after the attention).
void run_case(const Heads& h, int32_t b, int32_t kv, int32_t q_len, int32_t page, int replays,
              bool with_write, double ceiling, bench::JsonLines& json, cudaStream_t stream) {
  const int32_t bps = (kv + page - 1) / page;
  const int64_t t = int64_t(b) * q_len;
  const double kv_bytes = double(b) * kv * h.hkv * h.d * 2 * 2;
  const int n_sets = bench::l2_rotation_sets(kv_bytes);
  Cache c;
  c.h = h;
  c.page = page;
  c.num_blocks = int64_t(n_sets) * b * bps;
  c.k = bench::device_alloc<uint16_t>(c.elems());
  c.v = bench::device_alloc<uint16_t>(c.elems());
  bench::fill_normal_bf16(c.k, c.elems(), 1.0f, 11ull * kv + b, stream);
  bench::fill_normal_bf16(c.v, c.elems(), 1.0f, 13ull * kv + b, stream);
  bench::Rng rng(uint64_t(b) * 7919 + kv);
  const std::vector<int32_t> perm = random_permutation(c.num_blocks, rng);
  int32_t* tables = bench::to_device(perm);  // set s: rows [s * B, (s + 1) * B) of [*, bps]
  const size_t q_elems = size_t(t) * h.hq * h.d;
  uint16_t* queries = bench::device_alloc<uint16_t>(n_sets * q_elems);
  uint16_t* outs = bench::device_alloc<uint16_t>(n_sets * q_elems);
  bench::fill_normal_bf16(queries, n_sets * q_elems, 1.0f, 17ull * kv + b, stream);
  BENCH_CHECK(cudaMemsetAsync(outs, 0xff, n_sets * q_elems * 2, stream));  // NaN until written
  std::vector<int32_t> qsl(b + 1);
  for (int32_t r = 0; r <= b; ++r) qsl[r] = r * q_len;
  int32_t* d_qsl = bench::to_device(qsl);
  int32_t* d_seq = bench::to_device(std::vector<int32_t>(b, kv));

  peagle::PagedAttentionParams p = attention_params(c, b, t, bps, q_len);
  p.query_start_loc = d_qsl;
  p.seq_lens = d_seq;
  const peagle::PagedAttentionPlan plan = peagle::plan_paged_attention(p);
  const auto ws = plan_workspace(p, plan);
  std::vector<peagle::PagedAttentionParams> sets(n_sets, p);
  for (int s = 0; s < n_sets; ++s) {
    sets[s].query = queries + s * q_elems;
    sets[s].out = outs + s * q_elems;
    sets[s].block_table = tables + size_t(s) * b * bps;
  }
  auto step = [&](int i) {
    BENCH_CHECK(peagle::launch_paged_attention(sets[i % n_sets], plan, stream));
  };
  const double eager = bench::time_eager(step, stream, 2 * replays);
  const double graph = bench::time_graph(step, stream, bench::graph_calls(n_sets), replays);
  // Every set's output was written (NaN-poisoned before) and is finite.
  const std::vector<uint16_t> got = bench::to_host(outs, n_sets * q_elems);
  for (size_t i = 0; i < got.size(); ++i) {
    SANITY(std::isfinite(bench::bf16_to_float(got[i])), "%s B=%d kv=%d: out[%zu] not finite",
           heads_name(h).c_str(), b, kv, i);
  }
  const double gbps = kv_bytes / (graph * 1e-6) / 1e9;
  print_row("attn", h, b, kv, n_sets, plan.max_splits, impl_name(plan), graph, eager, gbps, ceiling,
            json, q_len, page);

  if (with_write) {
    // This step's q_len rows per request: positions kv - q_len .. kv - 1 of every request.
    const size_t row = size_t(h.hkv) * h.d;
    const double w_bytes = double(t) * row * 2 * 2 * 2;  // K and V, read + written
    const int w_sets = bench::l2_rotation_sets(w_bytes);
    uint16_t* kin = bench::device_alloc<uint16_t>(size_t(w_sets) * t * row);
    uint16_t* vin = bench::device_alloc<uint16_t>(size_t(w_sets) * t * row);
    bench::fill_normal_bf16(kin, size_t(w_sets) * t * row, 1.0f, 19ull * kv + b, stream);
    bench::fill_normal_bf16(vin, size_t(w_sets) * t * row, 1.0f, 23ull * kv + b, stream);
    std::vector<int64_t> slots(size_t(w_sets) * t);
    for (int s = 0; s < w_sets; ++s) {
      const int32_t* tab = &perm[size_t(s % n_sets) * b * bps];
      for (int32_t r = 0; r < b; ++r) {
        for (int32_t j = 0; j < q_len; ++j) {
          const int32_t pos = std::max(0, kv - q_len + j);
          slots[size_t(s) * t + r * q_len + j] =
              int64_t(tab[r * bps + pos / page]) * page + pos % page;
        }
      }
    }
    int64_t* d_slots = bench::to_device(slots);
    std::vector<peagle::WriteKvCacheParams> wsets;
    for (int s = 0; s < w_sets; ++s) {
      wsets.push_back(write_params(c, kin + size_t(s) * t * row, vin + size_t(s) * t * row,
                                   d_slots + size_t(s) * t, t));
    }
    auto write = [&](int i) {
      BENCH_CHECK(peagle::launch_write_kv_cache(wsets[i % w_sets], stream));
    };
    const double w_eager = bench::time_eager(write, stream, 2 * replays);
    const double w_graph = bench::time_graph(write, stream, bench::graph_calls(w_sets), replays);
    // The last set's rows are in the cache.
    const int last = (bench::graph_calls(w_sets) - 1) % w_sets;
    const std::vector<uint16_t> want = bench::to_host(kin + size_t(last) * t * row, t * row);
    const std::vector<uint16_t> cache = bench::to_host(c.k, c.elems());
    for (int64_t i = 0; i < t; ++i) {
      const int64_t slot = slots[size_t(last) * t + i];
      if (q_len > kv && i % q_len <= q_len - kv) continue;  // rows clamped to position 0 race
      for (size_t e = 0; e < row; ++e) {
        SANITY(cache[size_t(slot) * row + e] == want[i * row + e],
               "write_kv_cache: row %lld differs", static_cast<long long>(i));
      }
    }
    const double w_gbps = w_bytes / (w_graph * 1e-6) / 1e9;
    print_row("write_kv", h, b, kv, w_sets, 0, "-", w_graph, w_eager, w_gbps, ceiling, json, q_len,
              page);
    for (const void* ptr : {static_cast<const void*>(kin), static_cast<const void*>(vin),
                            static_cast<const void*>(d_slots)}) {
      BENCH_CHECK(cudaFree(const_cast<void*>(ptr)));
    }
  }
  for (const void* ptr : {static_cast<const void*>(c.k), static_cast<const void*>(c.v),
                          static_cast<const void*>(tables), static_cast<const void*>(queries),
                          static_cast<const void*>(outs), static_cast<const void*>(d_qsl),
                          static_cast<const void*>(d_seq), static_cast<const void*>(ws.first),
                          static_cast<const void*>(ws.second)}) {
    BENCH_CHECK(cudaFree(const_cast<void*>(ptr)));
  }
}

}  // namespace

int main(int argc, char** argv) {
  bench::Args args(argc, argv, kUsage);
  const bool quick = args.flag("--quick");
  const std::vector<int> batches =
      args.ints("--batch", quick ? std::vector<int>{1, 8} : std::vector<int>{1, 8, 64});
  const std::vector<int> kvs =
      args.ints("--kv", quick ? std::vector<int>{1024, 4096} : std::vector<int>{1024, 4096, 16384});
  const std::vector<std::string> head_specs =
      args.list("--heads", quick ? std::vector<std::string>{"32/8x128"}
                                 : std::vector<std::string>{"32/8x128", "64/8x64"});
  const int q_len = args.integer("--q-len", 14);
  const int page = args.integer("--page", 16);
  const int replays = args.integer("--replays", quick ? 30 : 100);
  const std::string json_path = args.str("--json", "");
  args.finish();
  std::vector<Heads> heads;
  for (const auto& s : head_specs) {
    Heads h;
    if (!parse_heads(s, h)) {
      std::fprintf(stderr, "bad --heads entry '%s'\n%s", s.c_str(), kUsage);
      return 2;
    }
    heads.push_back(h);
  }
  if (q_len < 1 || page < 1 || (page & (page - 1)) != 0 || replays < 1) {
    std::fprintf(stderr, "--q-len and --replays must be >= 1, --page a power of two\n%s", kUsage);
    return 2;
  }
  for (int kv : kvs) {
    if (kv < 1) {
      std::fprintf(stderr, "--kv entries must be >= 1\n%s", kUsage);
      return 2;
    }
  }

  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreate(&stream));
  for (const Heads& h : heads) sanity_check(h, stream);
  const double ceiling = bench::copy_ceiling_gbps(stream);
  bench::JsonLines json(json_path, "paged_attention", ceiling);
  std::printf("copy ceiling %.0f GB/s, q_len %d, page %d, bf16, causal bottom-right\n", ceiling,
              q_len, page);
  std::printf("%-8s %-9s %4s %6s %5s %6s %-9s %9s %9s %8s %7s\n", "op", "heads", "B", "kv", "sets",
              "splits", "impl", "graph_us", "eager_us", "GB/s", "%ceil");
  for (const Heads& h : heads) {
    for (int b : batches) {
      for (size_t i = 0; i < kvs.size(); ++i) {
        run_case(h, b, kvs[i], q_len, page, replays, i == 0, ceiling, json, stream);
      }
    }
  }
  BENCH_CHECK(cudaStreamDestroy(stream));
  return 0;
}
