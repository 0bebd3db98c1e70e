// CUDA write_kv_cache (torch-free): one CTA per token row copies its K and V rows ([Hkv, D] each)
// into the paged caches with the widest vector (16/8/4/2 bytes) that every pointer and stride
// allows. Rows whose slot is PADDING_SLOT_ID (-1), any other negative slot or a slot past the cache
// write nothing (the CPU op raises on the latter two). No host sync, CUDA-graph safe.
#include <cuda_runtime.h>

#include <cstdint>

#include "peagle/kernels/write_kv_cache.h"

namespace peagle {
namespace {

constexpr int kThreads = 128;

template <typename Vec>
__global__ void __launch_bounds__(kThreads) write_kv_cache_kernel(const WriteKvCacheParams p) {
  const int64_t t = blockIdx.x;
  const int64_t slot = p.slot_mapping[t];
  if (!kv_slot_in_cache(slot, p.num_blocks, p.block_size)) return;
  const int64_t blk = slot / p.block_size, off = slot % p.block_size;
  const int64_t e = p.elem_bytes;
  const int32_t vecs_per_head = static_cast<int32_t>(p.head_dim * e / sizeof(Vec));
  const int32_t total = vecs_per_head * p.num_kv_heads;
  const char* ksrc = p.key + t * p.key_stride_t * e;
  const char* vsrc = p.value + t * p.value_stride_t * e;
  char* kdst = p.key_cache + (blk * p.kc_stride_block + off * p.kc_stride_slot) * e;
  char* vdst = p.value_cache + (blk * p.vc_stride_block + off * p.vc_stride_slot) * e;
  for (int32_t i = threadIdx.x; i < total; i += kThreads) {
    const int32_t h = i / vecs_per_head, c = i - h * vecs_per_head;
    const Vec k = reinterpret_cast<const Vec*>(ksrc + h * p.key_stride_h * e)[c];
    const Vec v = reinterpret_cast<const Vec*>(vsrc + h * p.value_stride_h * e)[c];
    reinterpret_cast<Vec*>(kdst + h * p.kc_stride_head * e)[c] = k;
    reinterpret_cast<Vec*>(vdst + h * p.vc_stride_head * e)[c] = v;
  }
}

// Largest power-of-two vector width (<= 16 bytes) dividing every address and byte stride used.
int vector_bytes(const WriteKvCacheParams& p) {
  const int64_t e = p.elem_bytes;
  uint64_t bits = static_cast<uint64_t>(p.head_dim) * e;
  for (const void* ptr :
       {static_cast<const void*>(p.key), static_cast<const void*>(p.value),
        static_cast<const void*>(p.key_cache), static_cast<const void*>(p.value_cache)}) {
    bits |= reinterpret_cast<uintptr_t>(ptr);
  }
  for (int64_t s : {p.key_stride_t, p.key_stride_h, p.value_stride_t, p.value_stride_h,
                    p.kc_stride_block, p.kc_stride_slot, p.kc_stride_head, p.vc_stride_block,
                    p.vc_stride_slot, p.vc_stride_head}) {
    bits |= static_cast<uint64_t>(s * e);
  }
  for (int w : {16, 8, 4, 2}) {
    if ((bits & (w - 1)) == 0) return w;
  }
  return 1;
}

}  // namespace

cudaError_t launch_write_kv_cache(const WriteKvCacheParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.num_tokens > INT32_MAX) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.num_tokens));
  switch (vector_bytes(p)) {
    case 16:
      write_kv_cache_kernel<uint4><<<grid, kThreads, 0, stream>>>(p);
      break;
    case 8:
      write_kv_cache_kernel<uint2><<<grid, kThreads, 0, stream>>>(p);
      break;
    case 4:
      write_kv_cache_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(p);
      break;
    case 2:
      write_kv_cache_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(p);
      break;
    default:
      write_kv_cache_kernel<uint8_t><<<grid, kThreads, 0, stream>>>(p);
      break;
  }
  return cudaGetLastError();
}

}  // namespace peagle
