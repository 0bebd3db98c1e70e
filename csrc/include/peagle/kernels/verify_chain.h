// verify_chain: chain speculative verification straight from target logits, torch-free.
//
// Semantics (layout, greedy and random acceptance, filters, recovered and bonus tokens, Philox
// streams, where CPU and CUDA may round differently, outputs): SPEC.md §6.9, normative. The
// functions below implement them once for the CPU op and the CUDA kernels.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "peagle/common.h"
#include "peagle/kernels/philox.h"

namespace peagle {

enum class LogitsDtype : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct VerifyChainParams {
  // Target logits [num_rows, vocab_size], unit stride along the vocabulary.
  const void* logits = nullptr;
  LogitsDtype logits_dtype = LogitsDtype::kFloat32;
  int64_t logits_row_stride = 0;                 // elements between rows
  int64_t num_rows = 0;                          // R = T + B
  int32_t vocab_size = 0;                        // V
  int32_t num_reqs = 0;                          // B
  int64_t num_draft_tokens = 0;                  // T
  const int32_t* draft_token_ids = nullptr;      // [T]
  const int32_t* cu_num_draft_tokens = nullptr;  // [B], inclusive
  const float* temperature = nullptr;            // [B]
  const int64_t* seeds = nullptr;                // [B]
  const int64_t* offsets = nullptr;              // [B]
  const int32_t* top_k = nullptr;                // [B] or null
  const float* top_p = nullptr;                  // [B] or null
  const float* draft_probs = nullptr;            // [T, V] or null (argmax drafts: q one-hot)
  int64_t draft_probs_row_stride = 0;            // elements between rows
  const double* uniforms = nullptr;              // [T] or null (Philox)
  const bool* request_mask = nullptr;            // [B] or null (all real)
  const int32_t* bonus_token_ids = nullptr;      // [B] or null (bonus sampled from the bonus row)
  const float* exponentials = nullptr;           // [B, V] or null (recovered token by Gumbel-max)
  int64_t exponentials_row_stride = 0;           // elements between rows
  // Outputs.
  int32_t* output_token_ids = nullptr;    // [B, max_num_draft_tokens + 1], contiguous
  int32_t max_num_draft_tokens = 0;       // max_n
  int32_t* num_accepted = nullptr;        // [B]
  bool* accepted_per_position = nullptr;  // [B, max_n] or null
};

// ---- scalar helpers shared by the CPU op and the CUDA kernels ----------------------------------

PEAGLE_HD float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

PEAGLE_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

PEAGLE_HD float bf16_bits_to_float(uint16_t h) {
  return bits_to_float(static_cast<uint32_t>(h) << 16);
}

PEAGLE_HD float fp16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));  // inf/nan
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
    const float f = static_cast<float>(mantissa) * 5.9604644775390625e-08f;
    return sign ? -f : f;
  }
  return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// Element idx (row * stride + v) of the logits as float32 (exact for every input dtype).
PEAGLE_HD float load_logit(const void* base, LogitsDtype dtype, int64_t idx) {
  switch (dtype) {
    case LogitsDtype::kBFloat16:
      return bf16_bits_to_float(static_cast<const uint16_t*>(base)[idx]);
    case LogitsDtype::kFloat16:
      return fp16_bits_to_float(static_cast<const uint16_t*>(base)[idx]);
    default:
      return static_cast<const float*>(base)[idx];
  }
}

// NaN -> -inf, so that every comparison below is total (a NaN logit never wins and has p = 0).
PEAGLE_HD float sanitize_score(float s) {
  return s == s ? s : -INFINITY;
}

PEAGLE_HD bool is_greedy_temperature(float t) {
  return !(t > 0.0f);
}

PEAGLE_HD float inverse_temperature(float t) {
  return 1.0f / t;
}

PEAGLE_HD float score_of(float logit, float inv_t) {
  return sanitize_score(logit * inv_t);
}

// Unnormalised target weight e_v = expf(s_v - m) (precise expf).
PEAGLE_HD float weight_of(float s, float m) {
#if defined(__CUDA_ARCH__)
  return expf(s - m);
#else
  return std::exp(s - m);
#endif
}

PEAGLE_HD bool top_k_active(int32_t k, int32_t vocab) {
  return k > 0 && k < vocab;
}
PEAGLE_HD bool top_p_active(float p) {
  return !(p >= 1.0f);
}

// Target probability p(x) of an in-range draft x in the kept set, for the acceptance test:
// e_x / Z, except that a row whose maximum score m is +inf is one-hot at its first +inf index
// `first_max` (p = 1 there, 0 elsewhere; e_v = exp(s_v - m) would be NaN for every +inf score).
// This matches the sampled tokens, which fall back to `first_max` when no weight is finite.
PEAGLE_HD double kept_target_prob(float s_x, float m, double z, int32_t x, int32_t first_max) {
  if (m == INFINITY) return x == first_max ? 1.0 : 0.0;
  return static_cast<double>(weight_of(s_x, m)) / z;
}

// Acceptance of a random-mode draft with target probability p_x and draft probability q_x
// (1 without draft_probs). False whenever p_x or q_x is 0 or NaN.
PEAGLE_HD bool accept_draft(double u, double p_x, double q_x) {
  return p_x > 0.0 && q_x > 0.0 && u <= p_x / q_x;
}

// Running first-index argmax: values of -inf are never recorded (idx stays -1).
struct ArgMax {
  float val;
  int32_t idx;
};

PEAGLE_HD ArgMax argmax_none() {
  return ArgMax{-INFINITY, -1};
}

// True iff (val, idx) beats `cur`; ties go to the lower index. -inf never beats anything (an
// empty ArgMax holds -inf with idx -1, and candidate indices are >= 0).
PEAGLE_HD bool argmax_better(float val, int32_t idx, const ArgMax& cur) {
  return val > cur.val || (val == cur.val && idx < cur.idx);
}

PEAGLE_HD void argmax_push(ArgMax& cur, float val, int32_t idx) {
  if (argmax_better(val, idx, cur)) {
    cur.val = val;
    cur.idx = idx;
  }
}

PEAGLE_HD ArgMax argmax_merge(const ArgMax& a, const ArgMax& b) {
  if (b.idx < 0) return a;
  if (a.idx < 0) return b;
  return argmax_better(b.val, b.idx, a) ? b : a;
}

// Order-preserving 32-bit key of a float (larger float -> larger key; -inf lowest after NaN).
PEAGLE_HD uint32_t ordered_key(float f) {
  const uint32_t bits = float_to_bits(f);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

PEAGLE_HD float key_to_float(uint32_t key) {
  return bits_to_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Draft span of request r with every index clamped into [0, T] (the CPU op rejects bad values
// before; the CUDA kernels can only clamp).
struct RequestSpan {
  int64_t first_draft;  // global index of draft 0 (= cu[r-1])
  int32_t num_drafts;   // n_r
  int64_t first_row;    // logits row of draft 0 (= cu[r-1] + r); the bonus row is first_row + n_r
};

PEAGLE_HD RequestSpan request_span(const int32_t* cu, int32_t r, int64_t num_drafts) {
  const int64_t lo = r > 0 ? clamp_val<int64_t>(cu[r - 1], 0, num_drafts) : 0;
  const int64_t hi = clamp_val<int64_t>(cu[r], lo, num_drafts);
  RequestSpan s;
  s.first_draft = lo;
  s.num_drafts = static_cast<int32_t>(hi - lo);
  s.first_row = lo + r;
  return s;
}

}  // namespace peagle

#if defined(PEAGLE_WITH_CUDA) || defined(__CUDACC__)
#include <cuda_runtime_api.h>
namespace peagle {
// Bytes of device scratch launch_verify_chain needs for these params (a few KB per row).
size_t verify_chain_workspace_bytes(const VerifyChainParams& p);
// The whole op on `stream`: no host synchronisation, graph-capturable; `workspace` must hold
// verify_chain_workspace_bytes(p) bytes (contents on entry are irrelevant).
cudaError_t launch_verify_chain(const VerifyChainParams& p, void* workspace, cudaStream_t stream);
// 32-bit words of persistent counters the one-kernel (fused) path needs for these params, 0 when
// the plan does not select it (top-k/top-p given, or PEAGLE_VERIFY_FUSED not set to 1). The
// counters must be zero before the first launch; every launch leaves them zero. Launches that
// share counters must not overlap in time (one stream or one graph).
size_t verify_chain_counter_words(const VerifyChainParams& p);
// As above; `counters` (verify_chain_counter_words(p) words, or null: the unfused path) selects
// the fused path where the plan allows it. Both paths give bit-identical results.
cudaError_t launch_verify_chain(const VerifyChainParams& p, void* workspace, uint32_t* counters,
                                cudaStream_t stream);
}  // namespace peagle
#endif
