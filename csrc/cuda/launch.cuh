// Launch helpers shared by the CUDA kernels (torch-free): the PDL switch, a launch with the
// programmatic-stream-serialization attribute, and the one SM-count convention.
//
//   PEAGLE_DISABLE_PDL=1   plain launches everywhere (read once per process); the kernels are
//                          correct either way (griddepcontrol.wait is a no-op without PDL).
//   sm_count(device)       multiprocessors of `device`, cached per device; 132 (an H100/H200's)
//                          when the query fails, so a plan never divides by zero.
#pragma once
#include <cuda_runtime.h>

#include <cstdlib>

namespace peagle {

inline bool pdl_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("PEAGLE_DISABLE_PDL");
    return v == nullptr || v[0] == '\0' || v[0] == '0';
  }();
  return enabled;
}

constexpr int kDefaultSmCount = 132;

inline int sm_count(int device) {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {0};
  if (device < 0 || device >= kMaxDevices) return kDefaultSmCount;
  if (cached[device] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        n <= 0) {
      (void)cudaGetLastError();
      n = kDefaultSmCount;
    }
    cached[device] = n;
  }
  return cached[device];
}

// SM count of the current device.
inline int sm_count() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return kDefaultSmCount;
  return sm_count(dev);
}

#ifdef __CUDACC__
// Launches kernel<<<grid, block, smem, stream>>>(args...) as a programmatic dependent of the
// previous kernel on the stream when PDL is enabled; a plain launch if it is not or the attribute
// is refused.
template <typename Kernel, typename... Args>
cudaError_t launch_pdl(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       const Args&... args) {
  if (pdl_enabled()) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (cudaLaunchKernelEx(&cfg, kernel, args...) == cudaSuccess) return cudaSuccess;
    (void)cudaGetLastError();
  }
  kernel<<<grid, block, smem, stream>>>(args...);
  return cudaGetLastError();
}

// Launches kernel as thread-block clusters of cluster_x CTAs along x (grid.x a multiple of it),
// as a programmatic dependent of the previous kernel when PDL is enabled (without the PDL
// attribute if it is refused). A cluster launch has no <<<>>> fallback: errors are returned.
template <typename Kernel, typename... Args>
cudaError_t launch_cluster_pdl(Kernel kernel, dim3 grid, dim3 block, size_t smem,
                               cudaStream_t stream, unsigned cluster_x, const Args&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster_x;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 2 : 1;
  if (cudaLaunchKernelEx(&cfg, kernel, args...) == cudaSuccess) return cudaSuccess;
  if (cfg.numAttrs == 1) return cudaGetLastError();
  (void)cudaGetLastError();
  cfg.numAttrs = 1;
  (void)cudaLaunchKernelEx(&cfg, kernel, args...);
  return cudaGetLastError();
}
#endif

}  // namespace peagle
