// Microbenchmark of chain verification from target logits (launch_verify_chain), torch-free.
// Uniform decode batches: B requests x K drafts, R = B * (K + 1) bf16 logits rows of V entries
// (random normal x 3, generated on the device), drafts equal to their row's argmax 80% of the
// time (so chains stop at varied depths). Modes: greedy (temperature 0), random T=0.7 (Philox
// draws from seeds/offsets) and random T=0.7 with top-k 50 / top-p 0.9 (B=64 only by default).
// Prints µs per call (CUDA graph of one rotation through the input sets, and eager), GB/s on
// the logits bytes read once (R * V * 2) and % of the copy ceiling measured in the same run.
// Inputs rotate through enough logits sets to touch >= 4x the L2 (cold L2).
//
// Before timing: greedy outputs are compared with a host argmax chain on a small ragged batch
// (B=3, V=1000, drafts 7/3/0), random rows are checked for well-formed outputs and for tokens
// inside the top-k set, and two runs must agree bit for bit.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_common.h"
#include "peagle/kernels/verify_chain.h"

namespace {

const char* kUsage =
    "bench_verify_chain [--batch 1,8,64] [--vocab 151936,201088] [--k 7]\n"
    "                   [--modes greedy,random,topk] [--topk-batch 64] [--replays 100]\n"
    "                   [--json FILE] [--quick]\n"
    "  modes: greedy (T=0), random (T=0.7, Philox), topk (T=0.7, top_k=50, top_p=0.9; run at\n"
    "  the --topk-batch sizes only). --quick: B=8, V=201088, fewer replays.\n";

constexpr int kThreads = 256;

// drafts[t] (uniform batch: request t / K, position t % K, row (t / K) * (K + 1) + t % K) = the
// first-index argmax of its logits row with probability 0.8, else a random id in [0, V).
__global__ void make_drafts_kernel(const uint16_t* logits, int32_t vocab, int32_t k,
                                   unsigned long long seed, int32_t* drafts) {
  const int64_t t = blockIdx.x;
  const int64_t row = (t / k) * (k + 1) + t % k;
  const uint16_t* x = logits + row * vocab;
  float best = -INFINITY;
  int32_t idx = INT32_MAX;
  for (int32_t v = threadIdx.x; v < vocab; v += kThreads) {
    const float f = peagle::bf16_bits_to_float(x[v]);
    if (f > best) best = f, idx = v;  // strided scan: the first hit is the lowest index
  }
  for (int off = 16; off > 0; off >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, off);
    const int32_t oi = __shfl_xor_sync(0xffffffffu, idx, off);
    if (ob > best || (ob == best && oi < idx)) best = ob, idx = oi;
  }
  __shared__ float sb[kThreads / 32];
  __shared__ int32_t si[kThreads / 32];
  if (threadIdx.x % 32 == 0) sb[threadIdx.x / 32] = best, si[threadIdx.x / 32] = idx;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kThreads / 32; ++w) {
    if (sb[w] > best || (sb[w] == best && si[w] < idx)) best = sb[w], idx = si[w];
  }
  const unsigned long long h = bench::bench_mix64(seed * 0x9E3779B97F4A7C15ull + t + 1);
  drafts[t] = (h % 10) < 8 ? idx : static_cast<int32_t>((h >> 8) % vocab);
}

struct Mode {
  const char* name;
  float temperature;
  int32_t top_k;  // 0: no top_k / top_p tensors
  float top_p;
};

// Host first-index argmax of row `row`.
int32_t host_argmax(const std::vector<uint16_t>& logits, int64_t row, int32_t vocab) {
  int32_t best = 0;
  for (int32_t v = 1; v < vocab; ++v) {
    if (bench::bf16_to_float(logits[row * vocab + v]) >
        bench::bf16_to_float(logits[row * vocab + best])) {
      best = v;
    }
  }
  return best;
}

// Tokens of the row with a strictly larger logit than token `x` (its 0-based rank, ties shared).
int64_t host_rank(const std::vector<uint16_t>& logits, int64_t row, int32_t vocab, int32_t x) {
  const float fx = bench::bf16_to_float(logits[row * vocab + x]);
  int64_t n = 0;
  for (int32_t v = 0; v < vocab; ++v) n += bench::bf16_to_float(logits[row * vocab + v]) > fx;
  return n;
}

#define SANITY(cond, ...)                                        \
  do {                                                           \
    if (!(cond)) {                                               \
      std::fprintf(stderr, "sanity check failed: " __VA_ARGS__); \
      std::fprintf(stderr, "\n");                                \
      std::exit(1);                                              \
    }                                                            \
  } while (0)

// Small ragged batch (drafts 7 / 3 / 0): request 0 greedy (exact host comparison), requests 1-2
// random (well-formed outputs, accepted prefix consistent, tokens inside the top-k set when
// filtered); run twice, results bit-identical.
void sanity_check(cudaStream_t stream) {
  const int32_t b = 3, v = 1000, max_n = 7;
  const std::vector<int32_t> cu = {7, 10, 10};
  const int64_t t = cu.back(), rows = t + b;
  uint16_t* d_logits = bench::device_alloc<uint16_t>(rows * v);
  bench::fill_normal_bf16(d_logits, rows * v, 3.0f, 77, stream);
  BENCH_CHECK(cudaStreamSynchronize(stream));
  const std::vector<uint16_t> logits = bench::to_host(d_logits, rows * v);
  // Request 0: all drafts equal the argmax (accept all, bonus row); request 1: argmax, then a
  // wrong token; request 2: no drafts.
  std::vector<int32_t> drafts(t);
  for (int j = 0; j < 7; ++j) drafts[j] = host_argmax(logits, j, v);
  drafts[7] = host_argmax(logits, 7 + 1, v);
  drafts[8] = (host_argmax(logits, 8 + 1, v) + 1) % v;
  drafts[9] = host_argmax(logits, 9 + 1, v);
  for (bool filtered : {false, true}) {
    for (bool greedy_all : {true, false}) {
      const std::vector<float> temp = {0.f, greedy_all ? 0.f : 0.7f, greedy_all ? 0.f : 0.7f};
      peagle::VerifyChainParams p;
      p.logits = d_logits;
      p.logits_dtype = peagle::LogitsDtype::kBFloat16;
      p.logits_row_stride = v;
      p.num_rows = rows;
      p.vocab_size = v;
      p.num_reqs = b;
      p.num_draft_tokens = t;
      p.draft_token_ids = bench::to_device(drafts);
      p.cu_num_draft_tokens = bench::to_device(cu);
      p.temperature = bench::to_device(temp);
      p.seeds = bench::to_device(std::vector<int64_t>{11, 12, 13});
      p.offsets = bench::to_device(std::vector<int64_t>{0, 5, 9});
      if (filtered) {
        p.top_k = bench::to_device(std::vector<int32_t>{50, 50, 50});
        p.top_p = bench::to_device(std::vector<float>{0.9f, 0.9f, 0.9f});
      }
      p.output_token_ids = bench::device_alloc<int32_t>(b * (max_n + 1));
      p.max_num_draft_tokens = max_n;
      p.num_accepted = bench::device_alloc<int32_t>(b);
      p.accepted_per_position = bench::device_alloc<bool>(b * max_n);
      void* ws = bench::device_alloc<char>(peagle::verify_chain_workspace_bytes(p));
      std::vector<int32_t> out[2], acc[2];
      std::vector<uint8_t> app;
      for (int run = 0; run < 2; ++run) {
        BENCH_CHECK(cudaMemset(p.output_token_ids, 0x55, sizeof(int32_t) * b * (max_n + 1)));
        BENCH_CHECK(cudaMemset(p.num_accepted, 0x55, sizeof(int32_t) * b));
        BENCH_CHECK(cudaMemset(p.accepted_per_position, 0x55, b * max_n));
        BENCH_CHECK(peagle::launch_verify_chain(p, ws, stream));
        BENCH_CHECK(cudaStreamSynchronize(stream));
        out[run] = bench::to_host(p.output_token_ids, b * (max_n + 1));
        acc[run] = bench::to_host(p.num_accepted, b);
        app = bench::to_host(reinterpret_cast<const uint8_t*>(p.accepted_per_position), b * max_n);
      }
      SANITY(out[0] == out[1] && acc[0] == acc[1], "two runs differ");
      for (int32_t r = 0; r < b; ++r) {
        const int64_t lo = r ? cu[r - 1] : 0, n = cu[r] - lo, row0 = lo + r;
        const int32_t na = acc[0][r];
        const int32_t* o = &out[0][r * (max_n + 1)];
        if (temp[r] == 0.f) {  // host argmax chain
          int32_t want = 0;
          while (want < n && drafts[lo + want] == host_argmax(logits, row0 + want, v)) ++want;
          SANITY(na == want, "greedy request %d: num_accepted %d, host %d", r, na, want);
          for (int32_t j = 0; j <= max_n; ++j) {
            const int32_t w =
                j < want ? drafts[lo + j] : (j == want ? host_argmax(logits, row0 + j, v) : -1);
            SANITY(o[j] == w, "greedy request %d position %d: %d, host %d", r, j, o[j], w);
          }
        } else {
          SANITY(na >= 0 && na <= n, "random request %d: num_accepted %d of %lld", r, na,
                 static_cast<long long>(n));
          for (int32_t j = 0; j <= max_n; ++j) {
            if (j < na) SANITY(o[j] == drafts[lo + j], "request %d: accepted token differs", r);
            if (j <= na) {
              SANITY(o[j] >= 0 && o[j] < v, "request %d position %d: token %d", r, j, o[j]);
              if (filtered) {
                SANITY(host_rank(logits, row0 + j, v, o[j]) < 50,
                       "request %d position %d: token %d outside the top 50", r, j, o[j]);
              }
            } else {
              SANITY(o[j] == -1, "request %d position %d: %d, want -1", r, j, o[j]);
            }
          }
        }
        for (int32_t j = 0; j < max_n; ++j) {
          SANITY(app[r * max_n + j] == (j < na ? 1 : 0), "accepted_per_position[%d, %d]", r, j);
        }
      }
      for (const void* ptr :
           {static_cast<const void*>(p.draft_token_ids),
            static_cast<const void*>(p.cu_num_draft_tokens),
            static_cast<const void*>(p.temperature), static_cast<const void*>(p.seeds),
            static_cast<const void*>(p.offsets), static_cast<const void*>(p.top_k),
            static_cast<const void*>(p.top_p), static_cast<const void*>(p.output_token_ids),
            static_cast<const void*>(p.num_accepted),
            static_cast<const void*>(p.accepted_per_position), static_cast<const void*>(ws)}) {
        BENCH_CHECK(cudaFree(const_cast<void*>(ptr)));
      }
    }
  }
  BENCH_CHECK(cudaFree(d_logits));
  std::printf(
      "sanity check passed (B=3, V=1000, drafts 7/3/0: greedy exact vs host argmax, "
      "random well-formed, top-k respected, deterministic)\n");
}

void run_case(int32_t b, int32_t v, int32_t k, const Mode& m, int replays, double ceiling,
              bench::JsonLines& json, cudaStream_t stream) {
  const int64_t t = int64_t(b) * k, rows = int64_t(b) * (k + 1);
  const double logit_bytes = double(rows) * v * 2;
  const int n_sets = bench::l2_rotation_sets(logit_bytes);
  uint16_t* logits = bench::device_alloc<uint16_t>(size_t(n_sets) * rows * v);
  int32_t* drafts = bench::device_alloc<int32_t>(size_t(n_sets) * t);
  bench::fill_normal_bf16(logits, size_t(n_sets) * rows * v, 3.0f, 1000003ull * b + v, stream);
  for (int s = 0; s < n_sets; ++s) {
    make_drafts_kernel<<<unsigned(t), kThreads, 0, stream>>>(logits + size_t(s) * rows * v, v, k,
                                                             s + 17, drafts + size_t(s) * t);
    BENCH_CHECK(cudaGetLastError());
  }
  std::vector<int32_t> cu(b);
  std::vector<int64_t> seeds(b), offsets(b, 0);
  for (int32_t r = 0; r < b; ++r) cu[r] = (r + 1) * k, seeds[r] = 1234 + r;
  peagle::VerifyChainParams p;
  p.logits_dtype = peagle::LogitsDtype::kBFloat16;
  p.logits_row_stride = v;
  p.num_rows = rows;
  p.vocab_size = v;
  p.num_reqs = b;
  p.num_draft_tokens = t;
  p.cu_num_draft_tokens = bench::to_device(cu);
  p.temperature = bench::to_device(std::vector<float>(b, m.temperature));
  p.seeds = bench::to_device(seeds);
  p.offsets = bench::to_device(offsets);
  if (m.top_k > 0) {
    p.top_k = bench::to_device(std::vector<int32_t>(b, m.top_k));
    p.top_p = bench::to_device(std::vector<float>(b, m.top_p));
  }
  p.output_token_ids = bench::device_alloc<int32_t>(size_t(b) * (k + 1));
  p.max_num_draft_tokens = k;
  p.num_accepted = bench::device_alloc<int32_t>(b);
  const size_t ws_bytes = peagle::verify_chain_workspace_bytes(p);
  void* ws = bench::device_alloc<char>(ws_bytes);
  std::vector<peagle::VerifyChainParams> sets(n_sets, p);
  for (int s = 0; s < n_sets; ++s) {
    sets[s].logits = logits + size_t(s) * rows * v;
    sets[s].draft_token_ids = drafts + size_t(s) * t;
  }
  auto step = [&](int i) {
    BENCH_CHECK(peagle::launch_verify_chain(sets[i % n_sets], ws, stream));
  };
  const double eager = bench::time_eager(step, stream, 2 * replays);
  const double graph = bench::time_graph(step, stream, bench::graph_calls(n_sets), replays);
  // The last call's outputs must be well formed.
  const std::vector<int32_t> out = bench::to_host(p.output_token_ids, size_t(b) * (k + 1));
  const std::vector<int32_t> acc = bench::to_host(p.num_accepted, b);
  for (int32_t r = 0; r < b; ++r) {
    SANITY(acc[r] >= 0 && acc[r] <= k, "num_accepted[%d] = %d", r, acc[r]);
    for (int32_t j = 0; j <= k; ++j) {
      const int32_t o = out[size_t(r) * (k + 1) + j];
      SANITY(j <= acc[r] ? (o >= 0 && o < v) : o == -1, "output[%d, %d] = %d", r, j, o);
    }
  }
  const double gbps = logit_bytes / (graph * 1e-6) / 1e9;
  std::printf("%7d %4d %-8s %5d %9.2f %9.2f %8.0f %6.1f%%\n", v, b, m.name, n_sets, graph, eager,
              gbps, 100.0 * gbps / ceiling);
  json.row("\"V\":" + std::to_string(v) + ",\"B\":" + std::to_string(b) +
               ",\"K\":" + std::to_string(k) + ",\"mode\":\"" + m.name +
               "\",\"input_sets\":" + std::to_string(n_sets),
           graph, eager, gbps);
  for (const void* ptr :
       {static_cast<const void*>(logits), static_cast<const void*>(drafts),
        static_cast<const void*>(p.cu_num_draft_tokens), static_cast<const void*>(p.temperature),
        static_cast<const void*>(p.seeds), static_cast<const void*>(p.offsets),
        static_cast<const void*>(p.top_k), static_cast<const void*>(p.top_p),
        static_cast<const void*>(p.output_token_ids), static_cast<const void*>(p.num_accepted),
        static_cast<const void*>(ws)}) {
    BENCH_CHECK(cudaFree(const_cast<void*>(ptr)));
  }
}

}  // namespace

int main(int argc, char** argv) {
  bench::Args args(argc, argv, kUsage);
  const bool quick = args.flag("--quick");
  const std::vector<int> batches =
      args.ints("--batch", quick ? std::vector<int>{8} : std::vector<int>{1, 8, 64});
  const std::vector<int> vocabs =
      args.ints("--vocab", quick ? std::vector<int>{201088} : std::vector<int>{151936, 201088});
  const std::vector<int> topk_batches =
      args.ints("--topk-batch", quick ? std::vector<int>{8} : std::vector<int>{64});
  const int k = args.integer("--k", 7);
  const int replays = args.integer("--replays", quick ? 30 : 100);
  const std::vector<std::string> modes = args.list("--modes", {"greedy", "random", "topk"});
  const std::string json_path = args.str("--json", "");
  args.finish();
  if (k < 1 || replays < 1) {
    std::fprintf(stderr, "--k and --replays must be >= 1\n%s", kUsage);
    return 2;
  }
  const Mode all_modes[] = {
      {"greedy", 0.f, 0, 1.f}, {"random", 0.7f, 0, 1.f}, {"topk", 0.7f, 50, 0.9f}};
  for (const auto& name : modes) {
    bool known = false;
    for (const Mode& m : all_modes) known = known || name == m.name;
    if (!known) {
      std::fprintf(stderr, "unknown mode '%s'\n%s", name.c_str(), kUsage);
      return 2;
    }
  }

  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreate(&stream));
  sanity_check(stream);
  const double ceiling = bench::copy_ceiling_gbps(stream);
  bench::JsonLines json(json_path, "verify_chain", ceiling);
  std::printf("copy ceiling %.0f GB/s, K=%d, bf16 logits; GB/s = logits bytes read once\n", ceiling,
              k);
  std::printf("%7s %4s %-8s %5s %9s %9s %8s %7s\n", "V", "B", "mode", "sets", "graph_us",
              "eager_us", "GB/s", "%ceil");
  auto selected = [&](const Mode& m) {
    for (const auto& name : modes) {
      if (name == m.name) return true;
    }
    return false;
  };
  for (int v : vocabs) {
    for (int b : batches) {
      for (const Mode& m : all_modes) {
        if (m.top_k == 0 && selected(m)) run_case(b, v, k, m, replays, ceiling, json, stream);
      }
    }
  }
  // Filtered rows: the largest V only, at the --topk-batch sizes.
  for (int b : topk_batches) {
    for (const Mode& m : all_modes) {
      if (m.top_k > 0 && selected(m)) {
        run_case(b, vocabs.back(), k, m, replays, ceiling, json, stream);
      }
    }
  }
  BENCH_CHECK(cudaStreamDestroy(stream));
  return 0;
}
