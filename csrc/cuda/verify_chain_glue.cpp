// CUDA launcher of verify_chain (called by csrc/ops/verify_chain.cpp after the checks): device
// guard, scratch workspace from the caching allocator (graph-safe: allocated from the capture pool
// when capturing), the fused path's persistent counters, current stream, launch. Compiled by the
// host compiler (BUILD.md §7).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <mutex>
#include <vector>

#include "peagle/backends.h"

namespace peagle {
namespace {

// The fused path's counters: one zeroed int32 buffer per device, allocated (and zeroed, with one
// stream synchronisation) the first time a call needs it outside graph capture, grown the same
// way; the kernel leaves it zeroed. Buffers are never freed: a captured graph keeps using the one
// it was captured with. Returns null (the caller takes the unfused path, same results) when a
// bigger buffer would have to be made during capture.
uint32_t* persistent_counters(c10::Device device, size_t words, cudaStream_t stream) {
  static std::mutex mu;
  static std::vector<std::vector<at::Tensor>> per_device;
  const std::lock_guard<std::mutex> lock(mu);
  const auto d = static_cast<size_t>(device.index() < 0 ? 0 : device.index());
  if (per_device.size() <= d) per_device.resize(d + 1);
  auto& bufs = per_device[d];
  if (!bufs.empty() && static_cast<size_t>(bufs.back().numel()) >= words) {
    return reinterpret_cast<uint32_t*>(bufs.back().data_ptr<int32_t>());
  }
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  if (status != cudaStreamCaptureStatusNone) return nullptr;
  size_t n = size_t(1) << 16;  // 64K words: B up to ~21800 requests
  while (n < words) n *= 2;
  at::Tensor buf =
      at::zeros({static_cast<int64_t>(n)}, at::TensorOptions().device(device).dtype(at::kInt));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  bufs.push_back(buf);
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
