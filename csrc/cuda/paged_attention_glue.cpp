// CUDA launcher of paged_attention (called by csrc/ops/paged_attention.cpp after the checks):
// device guard, device facts and launch plan from host-known sizes, split-KV workspace
// (at::empty: stream-ordered, CUDA-graph safe), the cluster merge's arrival counters (see
// merge_counters), launch on the current stream. Compiled by the host compiler (BUILD.md §7).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "launch.cuh"
#include "peagle/backends.h"

namespace peagle {
namespace {

int device_attr(cudaDeviceAttr attr, c10::DeviceIndex device) {
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, attr, device));
  return n;
}

// Arrival counters of the cluster merge (PagedAttentionPlan::needs_counters): at least `n`
// zeroed uint32. Every launch leaves them zeroed again (the last arriver resets its counter), so
// eager calls and CUDA-graph replays reuse them with no memset. One buffer per (device, stream),
// allocated from the caching allocator on that stream and zeroed once: launches on one stream run
// one after the other and never share counters while in flight; eager launches on two streams
// get two buffers. While a stream is being captured (torch.cuda.graph captures on its own
// stream) the graph takes a buffer of the device that is already large enough -- normally the
// one of the stream the warm-up call ran on -- so replays need no memset node; only when none
// exists is one allocated inside the capture (its zero fill then becomes a graph node). A graph
// therefore shares its buffer with the stream it was warmed up on: replaying it concurrently with
// launches on that stream, or with another graph sharing the buffer, is not supported (as for
// any static buffer of a graph). A buffer that grows is replaced; the old one stays alive (a
// captured graph may still use it). Counters are keyed by a slice's first (row, head), unique
// for a valid query_start_loc; a non-monotonic one (invalid: the CPU op and
// PEAGLE_DEBUG_CHECKS=1 reject it) makes requests share rows and can leave a counter non-zero,
// which would spoil later cluster-merge calls on that stream (PEAGLE_ATTN_MERGE=kernel has no
// such state).
uint32_t* merge_counters(c10::Device device, cudaStream_t stream, int64_t n) {
  // Never destroyed: freeing CUDA memory from static destructors at exit is unsafe.
  static std::mutex* mu = new std::mutex;
  static auto* buffers = new std::map<std::pair<int, cudaStream_t>, at::Tensor>;
  static auto* retired = new std::vector<at::Tensor>;
  const std::lock_guard<std::mutex> lock(*mu);
  const int dev = static_cast<int>(device.index());
  at::Tensor& buf = (*buffers)[{dev, stream}];
  if (buf.defined() && buf.numel() >= n) return reinterpret_cast<uint32_t*>(buf.data_ptr());
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  if (status != cudaStreamCaptureStatusNone) {
    for (auto& [key, other] : *buffers) {
      if (key.first == dev && other.defined() && other.numel() >= n) {
        return reinterpret_cast<uint32_t*>(other.data_ptr());
      }
    }
  }
  if (buf.defined()) retired->push_back(buf);
  constexpr int64_t kMinCounters = int64_t{1} << 16;  // 256 KB: T * Hq up to 64K
  buf = at::zeros({std::max(n, kMinCounters)}, at::TensorOptions().device(device).dtype(at::kInt));
  return reinterpret_cast<uint32_t*>(buf.data_ptr());
}

}  // namespace

void paged_attention_cuda(PagedAttentionParams& p, c10::Device device) {
  // After the checks: a mixed-device call must report the argument, not fail in the guard.
  const c10::cuda::CUDAGuard guard(device);
  if (p.num_tokens == 0) return;  // B == 0 and T == 0, or T == 0 (EDGE_CASES B2)
  const c10::DeviceIndex dev = device.index();
  p.num_sms = sm_count(dev);
  p.arch = device_attr(cudaDevAttrComputeCapabilityMajor, dev) * 10 +
           device_attr(cudaDevAttrComputeCapabilityMinor, dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const PagedAttentionPlan plan = plan_paged_attention(p);
  if (plan.needs_counters) {
    p.ws_counters = merge_counters(device, stream, p.num_tokens * p.num_q_heads);
  }
  at::Tensor ws_out, ws_lse;
  if (plan.needs_workspace) {
    const auto f32 = at::TensorOptions().device(device).dtype(at::kFloat);
    ws_out = at::empty({plan.ws_partials, p.num_tokens, p.num_q_heads, p.head_dim}, f32);
    ws_lse = at::empty({plan.ws_partials, p.num_tokens, p.num_q_heads}, f32);
    p.ws_out = ws_out.data_ptr<float>();
    p.ws_lse = ws_lse.data_ptr<float>();
    p.max_splits = plan.max_splits;
  }
  C10_CUDA_CHECK(launch_paged_attention(p, plan, stream));
}

}  // namespace peagle
