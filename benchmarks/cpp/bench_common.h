// Shared helpers for the torch-free microbenchmarks: error checks, CUDA-event timing (median),
// CUDA-graph timing of N back-to-back launches, the device-to-device copy ceiling measured
// in the same run (bytes read + written, PERF.md §4), cold-L2 rotation counts, random device
// inputs, command-line flags and JSON-lines output.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#define BENCH_CHECK(expr)                                                                         \
  do {                                                                                            \
    cudaError_t _e = (expr);                                                                      \
    if (_e != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(_e)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

namespace bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Median µs of one launch, timed with events around each launch (launch overhead included).
inline double time_eager(const std::function<void(int)>& fn, cudaStream_t s, int iters = 200,
                         int warmup = 20) {
  for (int i = 0; i < warmup; ++i) fn(i);
  BENCH_CHECK(cudaStreamSynchronize(s));
  std::vector<cudaEvent_t> a(iters), b(iters);
  for (int i = 0; i < iters; ++i) {
    BENCH_CHECK(cudaEventCreate(&a[i]));
    BENCH_CHECK(cudaEventCreate(&b[i]));
  }
  for (int i = 0; i < iters; ++i) {
    BENCH_CHECK(cudaEventRecord(a[i], s));
    fn(i);
    BENCH_CHECK(cudaEventRecord(b[i], s));
  }
  BENCH_CHECK(cudaStreamSynchronize(s));
  std::vector<double> t(iters);
  for (int i = 0; i < iters; ++i) {
    float ms = 0;
    BENCH_CHECK(cudaEventElapsedTime(&ms, a[i], b[i]));
    t[i] = ms * 1e3;
    cudaEventDestroy(a[i]);
    cudaEventDestroy(b[i]);
  }
  return median(t);
}

// Median µs per launch: `calls` launches captured in one graph, replayed `replays` times.
inline double time_graph(const std::function<void(int)>& fn, cudaStream_t s, int calls = 20,
                         int replays = 50) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  BENCH_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < calls; ++i) fn(i);
  BENCH_CHECK(cudaStreamEndCapture(s, &graph));
  BENCH_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) BENCH_CHECK(cudaGraphLaunch(exec, s));
  BENCH_CHECK(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  BENCH_CHECK(cudaEventCreate(&a));
  BENCH_CHECK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int r = 0; r < replays; ++r) {
    BENCH_CHECK(cudaEventRecord(a, s));
    BENCH_CHECK(cudaGraphLaunch(exec, s));
    BENCH_CHECK(cudaEventRecord(b, s));
    BENCH_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    BENCH_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1e3 / calls);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return median(t);
}

// Device-to-device copy bandwidth in GB/s (bytes read + written).
inline double copy_ceiling_gbps(cudaStream_t s, size_t bytes = size_t(2) << 30) {
  void *src, *dst;
  BENCH_CHECK(cudaMalloc(&src, bytes));
  BENCH_CHECK(cudaMalloc(&dst, bytes));
  BENCH_CHECK(cudaMemsetAsync(src, 0x5a, bytes, s));
  const double us = time_eager(
      [&](int) { BENCH_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s)); }, s,
      20, 3);
  cudaFree(src);
  cudaFree(dst);
  return 2.0 * bytes / (us * 1e-6) / 1e9;
}

// Simple reproducible generator (splitmix64) for host-side inputs.
struct Rng {
  unsigned long long x;
  explicit Rng(unsigned long long seed) : x(seed) {}
  unsigned long long next() {
    unsigned long long z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  int uniform(int lo, int hi) { return lo + static_cast<int>(next() % (hi - lo + 1)); }
};

// Input sets needed so that rotating through them touches `factor` x the L2 (PERF.md §4.7;
// benchmarks/timing.py l2_rotation_sets).
inline int l2_rotation_sets(double bytes_per_set, int factor = 4, int max_sets = 64) {
  int dev = 0, l2 = 0;
  BENCH_CHECK(cudaGetDevice(&dev));
  BENCH_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
  if (l2 <= 0) l2 = 60 << 20;
  if (bytes_per_set <= 0) return 1;
  const double need = static_cast<double>(factor) * l2 / bytes_per_set;
  return std::max(1, std::min(max_sets, static_cast<int>(need + 0.999999)));
}

// CUDA-graph calls per capture: one rotation through the input sets per replay (at least 4).
inline int graph_calls(int n_sets) {
  return std::max(4, std::min(n_sets, 64));
}

__device__ __forceinline__ unsigned long long bench_mix64(unsigned long long z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// dst[i] = bf16(scale * N(0, 1)) from a counter hash of (seed, i) and Box-Muller.
__global__ void bench_fill_normal_bf16_kernel(uint16_t* dst, size_t n, float scale,
                                              unsigned long long seed) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const unsigned long long h = bench_mix64(seed * 0x9E3779B97F4A7C15ull + i + 1);
    const float u1 = (static_cast<float>(h >> 40) + 1.0f) * 5.9604645e-08f;         // (0, 1]
    const float u2 = static_cast<float>((h >> 16) & 0xFFFFFFull) * 5.9604645e-08f;  // [0, 1)
    const float z = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    dst[i] = __bfloat16_as_ushort(__float2bfloat16_rn(scale * z));
  }
}

inline void fill_normal_bf16(void* dst, size_t n, float scale, unsigned long long seed,
                             cudaStream_t s) {
  if (n == 0) return;
  const size_t blocks = std::min<size_t>((n + 255) / 256, 132 * 32);
  bench_fill_normal_bf16_kernel<<<static_cast<unsigned>(blocks), 256, 0, s>>>(
      static_cast<uint16_t*>(dst), n, scale, seed);
  BENCH_CHECK(cudaGetLastError());
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
T* device_alloc(size_t n) {
  T* d = nullptr;
  BENCH_CHECK(cudaMalloc(&d, std::max<size_t>(n, 1) * sizeof(T)));
  return d;
}

template <typename T>
T* to_device(const std::vector<T>& v) {
  T* d = device_alloc<T>(v.size());
  if (!v.empty()) {
    BENCH_CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  return d;
}

template <typename T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> v(n);
  if (n) BENCH_CHECK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

// Command-line flags of the form `--name value` (and bare `--name` switches). Every flag must be
// read before finish(), which rejects unknown ones and prints `usage` for --help.
class Args {
 public:
  Args(int argc, char** argv, const char* usage) : usage_(usage) {
    for (int i = 1; i < argc; ++i) items_.push_back(argv[i]);
    used_.assign(items_.size(), false);
  }
  bool flag(const char* name) {
    const int i = find(name);
    if (i < 0) return false;
    used_[i] = true;
    return true;
  }
  std::string str(const char* name, const std::string& def) {
    const int i = find(name);
    if (i < 0) return def;
    if (i + 1 >= static_cast<int>(items_.size())) fail(name);
    used_[i] = used_[i + 1] = true;
    return items_[i + 1];
  }
  int integer(const char* name, int def) {
    const std::string v = str(name, "");
    return v.empty() ? def : parse_int(name, v);
  }
  // Comma-separated integers, e.g. `--batch 1,8,64`.
  std::vector<int> ints(const char* name, const std::vector<int>& def) {
    std::vector<std::string> parts = list(name, {});
    if (parts.empty()) return def;
    std::vector<int> out;
    for (const auto& p : parts) out.push_back(parse_int(name, p));
    return out;
  }
  std::vector<std::string> list(const char* name, const std::vector<std::string>& def) {
    const std::string v = str(name, "");
    if (v.empty()) return def;
    std::vector<std::string> out;
    size_t start = 0;
    while (start <= v.size()) {
      const size_t end = std::min(v.find(',', start), v.size());
      if (end > start) out.push_back(v.substr(start, end - start));
      start = end + 1;
    }
    return out;
  }
  void finish() {
    if (flag("--help") || flag("-h")) {
      std::printf("%s", usage_);
      std::exit(0);
    }
    for (size_t i = 0; i < items_.size(); ++i) {
      if (!used_[i]) {
        std::fprintf(stderr, "unknown argument '%s'\n%s", items_[i].c_str(), usage_);
        std::exit(2);
      }
    }
  }

 private:
  int find(const char* name) const {
    for (size_t i = 0; i < items_.size(); ++i) {
      if (items_[i] == name) return static_cast<int>(i);
    }
    return -1;
  }
  int parse_int(const char* name, const std::string& v) const {
    char* end = nullptr;
    const long x = std::strtol(v.c_str(), &end, 10);
    if (end == v.c_str() || *end != '\0') fail(name);
    return static_cast<int>(x);
  }
  [[noreturn]] void fail(const char* name) const {
    std::fprintf(stderr, "bad or missing value for %s\n%s", name, usage_);
    std::exit(2);
  }
  const char* usage_;
  std::vector<std::string> items_;
  std::vector<bool> used_;
};

// One JSON object per line (`--json FILE`); no-op without a file. Each line carries the GPU name
// and the copy ceiling so that lines from several runs can be concatenated.
class JsonLines {
 public:
  JsonLines(const std::string& path, const char* bench, double ceiling_gbps) : bench_(bench) {
    if (path.empty()) return;
    f_ = std::fopen(path.c_str(), "a");
    if (f_ == nullptr) {
      std::fprintf(stderr, "cannot open %s\n", path.c_str());
      std::exit(2);
    }
    int dev = 0;
    cudaDeviceProp prop;
    BENCH_CHECK(cudaGetDevice(&dev));
    BENCH_CHECK(cudaGetDeviceProperties(&prop, dev));
    gpu_ = prop.name;
    ceiling_ = ceiling_gbps;
  }
  ~JsonLines() {
    if (f_ != nullptr) std::fclose(f_);
  }
  JsonLines(const JsonLines&) = delete;
  JsonLines& operator=(const JsonLines&) = delete;
  // `fields`: the case's own members, already JSON (e.g. "\"B\":8,\"mode\":\"greedy\"").
  void row(const std::string& fields, double graph_us, double eager_us, double gbps) {
    if (f_ == nullptr) return;
    std::fprintf(f_,
                 "{\"bench\":\"%s\",\"gpu\":\"%s\",\"copy_ceiling_gbps\":%.1f,%s,"
                 "\"graph_us\":%.3f,\"eager_us\":%.3f,\"gbps\":%.1f,\"pct_of_copy\":%.1f}\n",
                 bench_.c_str(), gpu_.c_str(), ceiling_, fields.c_str(), graph_us, eager_us, gbps,
                 100.0 * gbps / ceiling_);
    std::fflush(f_);
  }

 private:
  std::FILE* f_ = nullptr;
  std::string bench_, gpu_;
  double ceiling_ = 0;
};

}  // namespace bench
