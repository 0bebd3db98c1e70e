// The two backends of every op, called by its one torch-facing entry (csrc/ops/<op>.cpp) after
// binding and checking the tensors: each takes only the op's params struct (plus, for CUDA, the
// device to run on).
//
//   CPU kernels    csrc/cpu/<op>.cpp          the CI oracle; also check input *values* and raise
//   CUDA launchers csrc/cuda/<op>_glue.cpp    device guard, scratch from the caching allocator,
//                                             current stream, launch_<op>() of csrc/cuda/<op>.cu
#pragma once
#include <c10/core/Device.h>
#include <torch/library.h>

#include "peagle/kernels/paged_attention.h"
#include "peagle/kernels/prepare_draft_inputs.h"
#include "peagle/kernels/verify_chain.h"
#include "peagle/kernels/write_kv_cache.h"

namespace peagle {

void paged_attention_cpu(const PagedAttentionParams& p);
void prepare_draft_inputs_cpu(const PrepareDraftInputsParams& p);
void prepare_next_token_ids_cpu(const NextTokenParams& p);
void verify_chain_cpu(const VerifyChainParams& p);
void write_kv_cache_cpu(const WriteKvCacheParams& p);

#ifdef PEAGLE_WITH_CUDA
// paged_attention_cuda fills the device facts (SM count, arch) and the split-KV workspace of p.
void paged_attention_cuda(PagedAttentionParams& p, c10::Device device);
void prepare_draft_inputs_cuda(const PrepareDraftInputsParams& p, c10::Device device);
void prepare_next_token_ids_cuda(const NextTokenParams& p, c10::Device device);
void verify_chain_cuda(const VerifyChainParams& p, c10::Device device);
void write_kv_cache_cuda(const WriteKvCacheParams& p, c10::Device device);
#endif

}  // namespace peagle

// Runs op's CPU kernel or (CUDA builds) its CUDA launcher on the params `p`, by the device of the
// tensor `t` (only CPU and CUDA are registered, so nothing else reaches an entry).
#ifdef PEAGLE_WITH_CUDA
#define PEAGLE_RUN(op, p, t) ((t).is_cpu() ? op##_cpu(p) : op##_cuda(p, (t).device()))
#else
#define PEAGLE_RUN(op, p, t) op##_cpu(p)
#endif

// Registers an op's one entry `fn` for both dispatch keys (CUDA only in CUDA builds); the entry
// sends CPU tensors to the CPU kernel and CUDA tensors to the launcher.
#ifdef PEAGLE_WITH_CUDA
#define PEAGLE_IMPL(name, fn)           \
  TORCH_LIBRARY_IMPL(peagle, CPU, m) {  \
    m.impl(name, fn);                   \
  }                                     \
  TORCH_LIBRARY_IMPL(peagle, CUDA, m) { \
    m.impl(name, fn);                   \
  }
#else
#define PEAGLE_IMPL(name, fn)          \
  TORCH_LIBRARY_IMPL(peagle, CPU, m) { \
    m.impl(name, fn);                  \
  }
#endif
