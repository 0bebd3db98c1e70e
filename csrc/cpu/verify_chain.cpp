// CPU implementation of verify_chain (SPEC.md §6; semantics in peagle/kernels/verify_chain.h).
// Requests run in parallel; within a request rows are verified lazily (a row after the first
// rejection is never read). Sums use fp64. Unlike the CUDA path it checks input values and
// raises on bad ones.
#include <ATen/Parallel.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "peagle/backends.h"
#include "peagle/torch_checks.h"

namespace peagle {
namespace {

void check_values(const VerifyChainParams& p) {
  const int32_t* cu = p.cu_num_draft_tokens;
  int32_t prev = 0;
  for (int32_t r = 0; r < p.num_reqs; ++r) {
    TORCH_CHECK(cu[r] >= prev, "peagle: cu_num_draft_tokens must be a non-decreasing inclusive ",
                "cumsum starting at >= 0, got [", r, "] = ", cu[r], " after ", prev);
    const int32_t n = cu[r] - prev;
    prev = cu[r];
    const bool real = p.request_mask == nullptr || p.request_mask[r];
    if (!real) continue;  // padding request: only its draft count matters
    TORCH_CHECK(n <= p.max_num_draft_tokens, "peagle: request ", r, " has ", n,
                " drafts but output_token_ids has room for max_n = ", p.max_num_draft_tokens,
                " (shape [B, max_n + 1])");
    const float t = p.temperature[r];
    TORCH_CHECK(t >= 0.0f && std::isfinite(t), "peagle: temperature[", r, "] = ", t,
                " must be finite and >= 0 (0 = greedy)");
    if (p.top_k != nullptr) {
      TORCH_CHECK(p.top_k[r] >= 0, "peagle: top_k[", r, "] = ", p.top_k[r],
                  " must be >= 0 (0 = off)");
    }
    if (p.top_p != nullptr) {
      const float tp = p.top_p[r];
      TORCH_CHECK(tp > 0.0f && tp <= 1.0f, "peagle: top_p[", r, "] = ", tp,
                  " must be in (0, 1] (1 = off)");
    }
    if (p.bonus_token_ids != nullptr) {
      const int32_t id = p.bonus_token_ids[r];
      TORCH_CHECK(id >= 0 && id < p.vocab_size, "peagle: bonus_token_ids[", r, "] = ", id,
                  " must be a token id in [0, V = ", p.vocab_size, ")");
    }
  }
  TORCH_CHECK(prev == p.num_draft_tokens,
              "peagle: cu_num_draft_tokens must end at T = ", p.num_draft_tokens,
              " (the length of draft_token_ids), got ", prev);
}

// Greedy: first-index argmax of a row (NaN never wins; all -inf -> 0).
int32_t row_argmax(const VerifyChainParams& p, int64_t row) {
  const int64_t base = row * p.logits_row_stride;
  ArgMax best = argmax_none();
  for (int32_t v = 0; v < p.vocab_size; ++v) {
    argmax_push(best, sanitize_score(load_logit(p.logits, p.logits_dtype, base + v)), v);
  }
  return best.idx < 0 ? 0 : best.idx;
}

// The random-mode target distribution of one row: p(v) = e_v / z for s_v >= tau, else 0.
struct RowDist {
  std::vector<float> s;   // scores, NaN -> -inf
  float m = -INFINITY;    // max score
  float tau = -INFINITY;  // kept iff s >= tau
  double z = 0.0;         // sum of weights over the kept set
  int32_t first_max = 0;  // first index of the max score (0 if no score is finite)
};

void build_row(const VerifyChainParams& p, int64_t row, float inv_t, int32_t top_k, float top_p,
               RowDist& d, std::vector<float>& scratch) {
  const int32_t vocab = p.vocab_size;
  const int64_t base = row * p.logits_row_stride;
  d.s.resize(vocab);
  ArgMax best = argmax_none();
  for (int32_t v = 0; v < vocab; ++v) {
    d.s[v] = score_of(load_logit(p.logits, p.logits_dtype, base + v), inv_t);
    argmax_push(best, d.s[v], v);
  }
  d.first_max = best.idx < 0 ? 0 : best.idx;
  d.m = best.idx < 0 ? -INFINITY : best.val;
  d.tau = -INFINITY;
  if (top_k_active(top_k, vocab)) {  // k-th largest score; ties at the threshold are kept
    scratch.assign(d.s.begin(), d.s.end());
    std::nth_element(scratch.begin(), scratch.begin() + (top_k - 1), scratch.end(),
                     std::greater<float>());
    d.tau = scratch[top_k - 1];
  }
  if (top_p_active(top_p)) {
    // Kept scores in descending order; keep a group of equal scores iff the mass strictly above
    // it is < top_p * (mass kept by top-k). The first group (the maximum) is always kept.
    scratch.clear();
    double zk = 0.0;
    for (int32_t v = 0; v < vocab; ++v) {
      if (d.s[v] >= d.tau) {
        scratch.push_back(d.s[v]);
        zk += weight_of(d.s[v], d.m);
      }
    }
    std::sort(scratch.begin(), scratch.end(), std::greater<float>());
    const double target = static_cast<double>(top_p) * zk;
    double before = 0.0;
    size_t i = 0;
    while (i < scratch.size()) {
      if (i > 0 && !(before < target)) break;
      const float sv = scratch[i];
      d.tau = sv;
      const double w = weight_of(sv, d.m);
      for (; i < scratch.size() && scratch[i] == sv; ++i) before += w;
    }
  }
  double z = 0.0;
  for (int32_t v = 0; v < vocab; ++v) {
    if (d.s[v] >= d.tau) z += weight_of(d.s[v], d.m);
  }
  d.z = z;
}

// Target probability of token x for the acceptance test (fp64; 0 if x is out of range or cut).
double target_prob(const RowDist& d, int32_t x, int32_t vocab) {
  if (x < 0 || x >= vocab || !(d.s[x] >= d.tau)) return 0.0;
  return kept_target_prob(d.s[x], d.m, d.z, x, d.first_max);
}

// vLLM's exponential race for the recovered token: argmax over v of residual(v) / e_row[v]
// (float32 division) among residual(v) > 0; residual = p with `exclude` removed (no draft_probs)
// or max(p - q, 0).
int32_t exponential_race(const VerifyChainParams& p, const RowDist& d, const float* e_row,
                         int32_t exclude, const float* q_row) {
  const float zf = static_cast<float>(d.z);
  ArgMax best = argmax_none();
  for (int32_t v = 0; v < p.vocab_size; ++v) {
    const float sv = d.s[v];
    const float pv = sv >= d.tau ? weight_of(sv, d.m) / zf : 0.0f;
    const float res = q_row != nullptr ? pv - q_row[v] : (v == exclude ? 0.0f : pv);
    if (!(res > 0.0f)) continue;
    argmax_push(best, res * (1.0f / e_row[v]), v);  // vLLM 0.28: prob * reciprocal(E)
  }
  return best.idx < 0 ? d.first_max : best.idx;
}

// Inverse-CDF sampling over the row in vocabulary order (kernels/verify_chain.h): weights
// w_v = e_v for kept v != exclude (no draft_probs) or max(p_v - q_v, 0); the first v whose
// cumulative weight (fp64) exceeds u * W. Empty residual: the first argmax of the scores.
int32_t sample_row(const VerifyChainParams& p, const RowDist& d, int64_t seed, int64_t offset,
                   uint32_t stream, int32_t exclude, const float* q_row) {
  const int32_t vocab = p.vocab_size;
  const float zf = static_cast<float>(d.z);
  auto weight = [&](int32_t v) -> double {
    const float sv = d.s[v];
    const bool kept = sv >= d.tau;
    if (q_row != nullptr) {
      const float res = (kept ? weight_of(sv, d.m) / zf : 0.0f) - q_row[v];
      return res > 0.0f ? static_cast<double>(res) : 0.0;
    }
    return kept && v != exclude ? static_cast<double>(weight_of(sv, d.m)) : 0.0;
  };
  double total = 0.0;
  for (int32_t v = 0; v < vocab; ++v) total += weight(v);
  if (!(total > 0.0)) return d.first_max;
  const double t = sampling_uniform(seed, offset, stream) * total;
  double cum = 0.0;
  int32_t last = d.first_max;
  for (int32_t v = 0; v < vocab; ++v) {
    const double w = weight(v);
    if (!(w > 0.0)) continue;
    cum += w;
    last = v;
    if (cum > t) return v;
  }
  return last;  // t rounded up to the total: the last token with weight
}

void write_inert(const VerifyChainParams& p, int32_t r) {
  const int64_t width = p.max_num_draft_tokens + 1;
  std::fill_n(p.output_token_ids + r * width, width, kPlaceholderTokenId);
  p.num_accepted[r] = 0;
  if (p.accepted_per_position != nullptr) {
    std::fill_n(p.accepted_per_position + static_cast<int64_t>(r) * p.max_num_draft_tokens,
                p.max_num_draft_tokens, false);
  }
}

void verify_request(const VerifyChainParams& p, int32_t r, RowDist& d,
                    std::vector<float>& scratch) {
  write_inert(p, r);
  if (p.request_mask != nullptr && !p.request_mask[r]) return;
  const RequestSpan span = request_span(p.cu_num_draft_tokens, r, p.num_draft_tokens);
  const int32_t n = std::min(span.num_drafts, p.max_num_draft_tokens);
  int32_t* out = p.output_token_ids + static_cast<int64_t>(r) * (p.max_num_draft_tokens + 1);
  const int32_t* drafts = p.draft_token_ids + span.first_draft;
  int32_t accepted = 0;
  int32_t last = 0;  // the correction or bonus token
  const float temp = p.temperature[r];

  if (is_greedy_temperature(temp)) {
    bool rejected = false;
    for (; accepted < n; ++accepted) {
      const int32_t a = row_argmax(p, span.first_row + accepted);
      if (drafts[accepted] != a) {
        last = a;  // the correction
        rejected = true;
        break;
      }
      out[accepted] = a;
    }
    if (!rejected) {
      last = p.bonus_token_ids != nullptr ? p.bonus_token_ids[r]
                                          : row_argmax(p, span.first_row + span.num_drafts);
    }
  } else {
    const float inv_t = inverse_temperature(temp);
    const int32_t top_k = p.top_k != nullptr ? p.top_k[r] : 0;
    const float top_p = p.top_p != nullptr ? p.top_p[r] : 1.0f;
    const int64_t seed = p.seeds[r], offset = p.offsets[r];
    bool rejected = false;
    for (; accepted < n; ++accepted) {
      const int64_t row = span.first_row + accepted;
      build_row(p, row, inv_t, top_k, top_p, d, scratch);
      const int32_t x = drafts[accepted];
      const int64_t draft_index = span.first_draft + accepted;
      const float* q_row = p.draft_probs != nullptr
                               ? p.draft_probs + draft_index * p.draft_probs_row_stride
                               : nullptr;
      const double q_x = q_row == nullptr ? 1.0 : (x >= 0 && x < p.vocab_size ? q_row[x] : 0.0);
      const double u = p.uniforms != nullptr
                           ? p.uniforms[draft_index]
                           : acceptance_uniform(seed, offset, static_cast<uint32_t>(accepted));
      if (accept_draft(u, target_prob(d, x, p.vocab_size), q_x)) {
        out[accepted] = x;
        continue;
      }
      last = p.exponentials != nullptr
                 ? exponential_race(p, d, p.exponentials + r * p.exponentials_row_stride, x, q_row)
                 : sample_row(p, d, seed, offset, kStreamRecovered, x, q_row);
      rejected = true;
      break;
    }
    if (!rejected && p.bonus_token_ids != nullptr) {
      last = p.bonus_token_ids[r];
    } else if (!rejected) {
      build_row(p, span.first_row + span.num_drafts, inv_t, top_k, top_p, d, scratch);
      last = sample_row(p, d, seed, offset, kStreamBonus, -1, nullptr);
    }
  }
  out[accepted] = last;
  p.num_accepted[r] = accepted;
  if (p.accepted_per_position != nullptr) {
    std::fill_n(p.accepted_per_position + static_cast<int64_t>(r) * p.max_num_draft_tokens,
                accepted, true);
  }
}

}  // namespace

void verify_chain_cpu(const VerifyChainParams& p) {
  check_values(p);
  at::parallel_for(0, p.num_reqs, 1, [&](int64_t begin, int64_t end) {
    RowDist d;
    std::vector<float> scratch;
    for (int64_t r = begin; r < end; ++r) verify_request(p, static_cast<int32_t>(r), d, scratch);
  });
}

}  // namespace peagle
