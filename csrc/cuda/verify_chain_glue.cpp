// CUDA launcher of verify_chain (called by csrc/ops/verify_chain.cpp after the checks): device
// guard, scratch workspace from the caching allocator (graph-safe: allocated from the capture pool
// when capturing), the one-kernel paths' persistent counters, current stream, launch. Compiled by
// the host compiler (BUILD.md §7).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "peagle/backends.h"

namespace peagle {
namespace {

// The one-kernel paths' counters (tail, fused): at least `words` zeroed uint32 that every launch
// leaves zeroed, so eager calls and graph replays reuse them with no memset. One buffer per
// (device, stream), allocated and zeroed on that stream the first time a call needs it: launches
// on one stream never overlap, eager launches on two streams get two buffers. While a stream is
// captured, the graph takes a buffer of the device that is already large enough (normally the
// one of the stream its warm-up ran on; replaying the graph concurrently with launches on that
// stream is not supported, as for any static buffer of a graph); when none exists it returns
// null and the call takes the multi-kernel path (same results). A buffer that grows is replaced;
// the old one stays alive (a captured graph may still use it).
uint32_t* persistent_counters(c10::Device device, size_t words, cudaStream_t stream) {
  // Never destroyed: freeing CUDA memory from static destructors at exit is unsafe.
  static std::mutex* mu = new std::mutex;
  static auto* buffers = new std::map<std::pair<int, cudaStream_t>, at::Tensor>;
  static auto* retired = new std::vector<at::Tensor>;
  const std::lock_guard<std::mutex> lock(*mu);
  const int dev = static_cast<int>(device.index() < 0 ? 0 : device.index());
  at::Tensor& buf = (*buffers)[{dev, stream}];
  if (buf.defined() && static_cast<size_t>(buf.numel()) >= words) {
    return reinterpret_cast<uint32_t*>(buf.data_ptr<int32_t>());
  }
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  if (status != cudaStreamCaptureStatusNone) {
    for (auto& [key, other] : *buffers) {
      if (key.first == dev && other.defined() && static_cast<size_t>(other.numel()) >= words) {
        return reinterpret_cast<uint32_t*>(other.data_ptr<int32_t>());
      }
    }
    return nullptr;
  }
  if (buf.defined()) retired->push_back(buf);
  size_t n = size_t(1) << 16;  // 64K words
  while (n < words) n *= 2;
  buf = at::zeros({static_cast<int64_t>(n)}, at::TensorOptions().device(device).dtype(at::kInt));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));  // once: zeroed before any stream may use it
  return reinterpret_cast<uint32_t*>(buf.data_ptr<int32_t>());
}

}  // namespace

void verify_chain_cuda(const VerifyChainParams& p, c10::Device device) {
  // After the checks: a mixed-device call must report the argument, not fail in the guard.
  const c10::cuda::CUDAGuard guard(device);
  if (p.num_reqs == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const size_t bytes = verify_chain_workspace_bytes(p);
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().device(device).dtype(at::kByte));
  const size_t words = verify_chain_counter_words(p);
  uint32_t* counters = words > 0 ? persistent_counters(device, words, stream) : nullptr;
  C10_CUDA_CHECK(launch_verify_chain(p, workspace.data_ptr(), counters, stream));
}

}  // namespace peagle
