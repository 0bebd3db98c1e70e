// Shared helpers for the torch-free microbenchmarks: error checks, CUDA-event timing (median),
// CUDA-graph timing of N back-to-back launches, and the device-to-device copy ceiling measured
// in the same run (bytes read + written, PERF.md §4).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define BENCH_CHECK(expr)                                                              \
  do {                                                                                 \
    cudaError_t _e = (expr);                                                           \
    if (_e != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr,               \
                   cudaGetErrorString(_e));                                            \
      std::exit(1);                                                                    \
    }                                                                                  \
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

}  // namespace bench
