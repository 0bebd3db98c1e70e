// verify_chain kernel 2 (only with top_k / top_p tensors), row_filter (torch-free; included by
// verify_chain.cu only): the kept-set threshold key and kept mass of every filtered row.
//
// The kept set is {v : score_key(s_v) >= tau}. Instead of radix passes over the whole row, every
// row is read once (split over nsplit CTAs) and only candidates are collected: keys at or above a
// bound t that provably contains the kept set:
//   top-k: t = max over splits of row_stats' bound (the k-th largest per-thread maximum of a
//          split): at least k scores are >= t, so the k-th largest score is >= t;
//   top-p only: t = m - D with D = ln(V / ((1 - top_p) Z)) + 0.05: the scores below t carry at
//          most (1 - top_p) of the mass, so the top-p cut lies at or above t.
// The last CTA of a row (arrival counter) selects exactly among the <= cand_cap candidate keys in
// shared memory (radix select: counts for top-k, 2^-32 fixed-point masses for top-p), and falls
// back to radix passes over the whole row when the candidates overflow or the top-p cut might lie
// below them. Masses are integers, so every sum is order-independent and the result
// deterministic.
//
// With row_stats' candidates (PEAGLE_VERIFY_TOPK_IN_STATS=1, row_filter_kernel<D, true>), a row
// with top_k <= kStatsTopK is not read again when its candidates prove the threshold: with
// T = max over splits of the split bounds, every element with key >= T is a candidate, and a
// split with bound T and >= top_k candidates proves that the top_k-th largest key is >= T, so the
// kept set (top-k, then top-p on the top-k-kept mass) lies among the candidates >= T. One CTA of
// the row selects exactly on them (select_threshold, as above); otherwise (an overflowing split,
// no such split, more than kCandCap candidates) the row takes the path above unchanged. Either
// way the kept set and its integer mass are the exact ones, so the results are the same bits.
#pragma once
#include "verify_chain_common.cuh"

namespace peagle {
namespace {

constexpr int kHistBins = 2048;  // 11-bit radix digits

// Candidate sets up to this size are selected by ranking (rank_select, n^2 / kThreads key
// compares per thread) instead of radix digits (~6 dependent histogram levels).
constexpr int kRankMax = 1024;

struct FilterSmem {
  alignas(16) uint32_t keys[kCandCap];  // this CTA's candidates, then the row's (last CTA)
  uint32_t tok[kRankMax];               // the first kRankMax candidates' tokens (write_kept)
  alignas(16) uint32_t cnt[kHistBins];  // radix counts; rank_select: the kept keys
  unsigned long long mass[kHistBins];   // radix masses; rank_select: the kept keys' masses
  unsigned long long tmp[kWarps];
  uint32_t red[kWarps];
  unsigned long long above;
  uint32_t kept;  // rank_select: kept keys appended
  uint32_t n;     // candidates appended by this CTA
  uint32_t base;  // where this CTA's candidates go in the row's buffer
  int32_t digit;
  int32_t last;  // this CTA is the row's last arrival
};

// Enumerates (key, score) over the candidate keys in shared memory.
struct SmemKeys {
  const uint32_t* keys;
  int32_t n;
  template <typename F>
  __device__ __forceinline__ void operator()(F&& f) const {
    for (int32_t i = threadIdx.x; i < n; i += kThreads) {
      const uint32_t k = keys[i];
      f(k, key_to_float(k));
    }
  }
};

// Enumerates (key, score) over a whole logits row (the fallback).
template <LogitsDtype D>
struct RowKeys {
  const char* rp;
  int32_t vocab;
  float inv_t;
  template <typename F>
  __device__ __forceinline__ void operator()(F&& f) const {
    stream_split<D>(rp, vocab, 0, 1, [&](int32_t, const float* x, auto cnt) {
      constexpr int kN = decltype(cnt)::value;
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        const float s = score_of(x[k], inv_t);
        f(score_key(s), s);
      }
    });
  }
};

__device__ __forceinline__ unsigned long long block_sum(unsigned long long x, FilterSmem& sm) {
  unsigned long long total;
  block_exclusive_scan(x, sm.tmp, &total);
  return total;
}

// Warp 0 finds a digit in a 2^bits-bin histogram scanned from the top. Count mode (top-k): the
// digit holding the `rank`-th largest element (rank >= 1). Mass mode (top-p): the lowest
// non-empty digit whose top element has (above + mass of higher digits) < target, else the highest
// non-empty digit (target <= 0: the maximum is always kept). Returns the digit (-1 if none) and,
// via *above_out, the count/mass of the higher digits.
template <bool kMass>
__device__ void find_digit(const uint32_t* cnt, const unsigned long long* mass, int bins,
                           unsigned long long rank, double target, unsigned long long above,
                           int* digit_out, unsigned long long* above_out) {
  const int lane = threadIdx.x % kWarp;
  const int per = bins / kWarp;
  const int lo = lane * per;
  unsigned long long mine = 0;
  for (int b = lo; b < lo + per; ++b) mine += kMass ? mass[b] : cnt[b];
  unsigned long long higher = 0;  // count/mass of the higher lanes' bins
  for (int l = 0; l < kWarp; ++l) {
    const unsigned long long x = __shfl_sync(0xffffffffu, mine, l);
    if (l > lane) higher += x;
  }
  int found = -1, top = -1;  // top: the highest non-empty digit (mass mode)
  unsigned long long found_above = 0;
  unsigned long long cum = higher;
  for (int b = lo + per - 1; b >= lo; --b) {
    const unsigned long long c = kMass ? mass[b] : cnt[b];
    if (kMass) {
      if (top < 0 && cnt[b] > 0) top = b;
      if (cnt[b] > 0 && static_cast<double>(above + cum) < target) {
        found = b;  // keep descending: the lowest such digit
        found_above = cum;
      }
    } else if (found < 0 && cum < rank && rank <= cum + c) {
      found = b;
      found_above = cum;
    }
    cum += c;
  }
  // Count mode: one lane finds the digit. Mass mode: the lowest digit found wins.
  int best = found < 0 ? 0x7fffffff : found;
  for (int d = kWarp / 2; d > 0; d >>= 1) best = min(best, __shfl_xor_sync(0xffffffffu, best, d));
  const unsigned won = __ballot_sync(0xffffffffu, found == best && found >= 0);
  const int src = won ? __ffs(static_cast<int>(won)) - 1 : 0;
  found_above = __shfl_sync(0xffffffffu, found_above, src);
  if (kMass && best == 0x7fffffff) {
    // No digit has mass above it < target: only when target <= 0 (a row whose maximum is +inf has
    // no finite weight). The top element's group is always kept (SPEC §6.7), so the highest
    // non-empty digit is chosen, with nothing above it.
    for (int d = kWarp / 2; d > 0; d >>= 1) top = max(top, __shfl_xor_sync(0xffffffffu, top, d));
    *digit_out = top;
    *above_out = 0;
    return;
  }
  *digit_out = best == 0x7fffffff ? -1 : best;
  *above_out = found_above;
}

// Radix digits, most significant first: shifts 21, 10, 0 with 11, 11, 10 bits.
__device__ __forceinline__ int radix_shift(int level) {
  return level == 0 ? 21 : (level == 1 ? 10 : 0);
}
__device__ __forceinline__ int radix_bins(int level) {
  return level == 2 ? 1024 : 2048;
}

// Top-k threshold: a key `kk` with exactly the elements of key >= the rank-th largest key at or
// above it (every element of the last refined bucket is kept), rank >= 1. Whole CTA.
template <typename Enum>
__device__ uint32_t radix_kth_key(const Enum& en, uint32_t rank, FilterSmem& sm) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  uint32_t prefix = 0, pmask = 0;
  unsigned long long left = rank;
  for (int level = 0; level < 3; ++level) {
    const int shift = radix_shift(level), bins = radix_bins(level);
    const uint32_t dmask = static_cast<uint32_t>(bins - 1);
    for (int b = threadIdx.x; b < bins; b += kThreads) sm.cnt[b] = 0;
    __syncthreads();
    en([&](uint32_t key, float) {
      if ((key & pmask) == prefix) atomicAdd(&sm.cnt[(key >> shift) & dmask], 1u);
    });
    __syncthreads();
    if (warp == 0) {
      int digit;
      unsigned long long above;
      find_digit<false>(sm.cnt, nullptr, bins, left, 0.0, 0, &digit, &above);
      if (lane == 0) {
        sm.digit = digit < 0 ? 0 : digit;  // cannot happen: 1 <= rank <= elements
        sm.above = above;
      }
    }
    __syncthreads();
    const uint32_t d = static_cast<uint32_t>(sm.digit);
    left -= sm.above;
    prefix |= d << shift;
    pmask |= dmask << shift;
    const bool whole_bucket = sm.cnt[d] == left;  // every element of the bucket is kept
    __syncthreads();
    if (whole_bucket) break;
  }
  return prefix;
}

// Top-p threshold among the elements with key >= kk: the key of the lowest kept group (a group is
// kept iff the mass of strictly greater keys is < target; the top group always is) and, in
// *z_out, the mass at or above it. target < 0: top_p times the mass at or above kk (computed on
// the first level). Whole CTA.
template <typename Enum>
__device__ void radix_top_p(const Enum& en, uint32_t kk, float ml, float top_p, double target,
                            FilterSmem& sm, uint32_t* key_out, unsigned long long* z_out) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  uint32_t prefix = 0, pmask = 0;
  unsigned long long above = 0, z_fixed = 0;
  for (int level = 0; level < 3; ++level) {
    const int shift = radix_shift(level), bins = radix_bins(level);
    const uint32_t dmask = static_cast<uint32_t>(bins - 1);
    for (int b = threadIdx.x; b < bins; b += kThreads) {
      sm.cnt[b] = 0;
      sm.mass[b] = 0;
    }
    __syncthreads();
    en([&](uint32_t key, float s) {
      if (key >= kk && (key & pmask) == prefix) {
        const uint32_t d = (key >> shift) & dmask;
        atomicAdd(&sm.cnt[d], 1u);
        const unsigned long long w = fixed_mass(fast_weight(s, ml));
        if (w) atomicAdd(&sm.mass[d], w);
      }
    });
    __syncthreads();
    if (level == 0 && target < 0.0) {
      unsigned long long t = 0;
      for (int b = threadIdx.x; b < bins; b += kThreads) t += sm.mass[b];
      target = static_cast<double>(top_p) * static_cast<double>(block_sum(t, sm));
    }
    if (warp == 0) {
      int digit;
      unsigned long long higher;
      find_digit<true>(sm.cnt, sm.mass, bins, 0, target, above, &digit, &higher);
      if (lane == 0) {
        sm.digit = digit < 0 ? bins - 1 : digit;  // -1 only without elements: keep everything
        sm.above = higher;
      }
    }
    __syncthreads();
    const uint32_t d = static_cast<uint32_t>(sm.digit);
    above += sm.above;
    prefix |= d << shift;
    pmask |= dmask << shift;
    const bool single = sm.cnt[d] <= 1;
    z_fixed = above + sm.mass[d];
    __syncthreads();
    if (single) break;
  }
  *key_out = prefix > kk ? prefix : kk;
  *z_out = z_fixed;
}

// Mass of the enumerated elements with key >= kk. Whole CTA.
template <typename Enum>
__device__ unsigned long long kept_mass(const Enum& en, uint32_t kk, float ml, FilterSmem& sm) {
  unsigned long long t = 0;
  en([&](uint32_t key, float s) {
    if (key >= kk) t += fixed_mass(fast_weight(s, ml));
  });
  return block_sum(t, sm);
}

// Zero-pads the n candidate keys in sm.keys to a multiple of 4 (count_above reads 16-byte words)
// and ends with a barrier.
__device__ __forceinline__ void pad_keys(FilterSmem& sm, uint32_t n) {
  if (threadIdx.x < 4 && n + threadIdx.x < static_cast<uint32_t>(kCandCap)) {
    sm.keys[n + threadIdx.x] = 0;
  }
  __syncthreads();
}

// Block-wide minimum of one value per thread (all threads must call).
__device__ __forceinline__ uint32_t block_min_u32(uint32_t x, FilterSmem& sm) {
#pragma unroll
  for (int d = kWarp / 2; d > 0; d >>= 1) x = min(x, __shfl_xor_sync(0xffffffffu, x, d));
  if (threadIdx.x % kWarp == 0) sm.red[threadIdx.x / kWarp] = x;
  __syncthreads();
  uint32_t r = sm.red[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) r = min(r, sm.red[w]);
  __syncthreads();  // sm.red may be reused right after
  return r;
}

// Number of the n keys (zero-padded to a multiple of 4, 16-byte aligned) strictly above k; all
// lanes read the same words (broadcast).
__device__ __forceinline__ uint32_t count_above(const uint32_t* keys, int32_t n, uint32_t k) {
  uint32_t c = 0;
  const uint4* k4 = reinterpret_cast<const uint4*>(keys);
  for (int32_t j = 0; j < (n + 3) / 4; ++j) {
    const uint4 q = k4[j];
    c += (q.x > k) + (q.y > k) + (q.z > k) + (q.w > k);
  }
  return c;
}

// The exact threshold among n <= kRankMax candidate keys by ranking: the top_k-th largest key kk
// is the smallest key with fewer than top_k keys strictly above it; the keys >= kk (with their
// masses) are then compacted into sm.cnt / sm.mass, and the top-p cut is the smallest kept key
// whose strictly-greater kept mass is < target (the top key when none is). The same kept set and
// integer kept mass as radix_kth_key + radix_top_p (their key may be a digit prefix below this
// one with no candidate in between). target < 0: top_p times the kept mass. Whole CTA; the keys
// must be zero-padded to a multiple of 4.
__device__ void rank_select(const uint32_t* keys, int32_t n, bool topk, int32_t top_k, bool topp,
                            float top_p, double target, float ml, FilterSmem& sm, uint32_t* key_out,
                            unsigned long long* z_out) {
  uint32_t kk = 0;
  if (topk) {
    uint32_t lo = 0xffffffffu;
    for (int32_t i = threadIdx.x; i < n; i += kThreads) {
      const uint32_t k = keys[i];
      if (count_above(keys, n, k) < static_cast<uint32_t>(top_k)) lo = min(lo, k);
    }
    kk = block_min_u32(lo, sm);  // n >= top_k: some key has fewer than top_k above it
  }
  if (threadIdx.x == 0) sm.kept = 0;
  __syncthreads();
  unsigned long long t = 0;
  for (int32_t i = threadIdx.x; i < n; i += kThreads) {
    const uint32_t k = keys[i];
    if (k >= kk) {
      const unsigned long long w = fixed_mass(fast_weight(key_to_float(k), ml));
      t += w;
      if (topp) {
        const uint32_t pos = atomicAdd(&sm.kept, 1u);
        sm.cnt[pos] = k;
        sm.mass[pos] = w;
      }
    }
  }
  const unsigned long long total = block_sum(t, sm);  // its barriers publish sm.kept and the list
  if (!topp) {
    *key_out = kk;
    *z_out = total;
    return;
  }
  const int32_t m = static_cast<int32_t>(sm.kept);
  if (target < 0.0) target = static_cast<double>(top_p) * static_cast<double>(total);
  uint32_t lo = 0xffffffffu;
  bool found = false;
  for (int32_t i = threadIdx.x; i < m; i += kThreads) {
    const uint32_t k = sm.cnt[i];
    unsigned long long above = 0;
    for (int32_t j = 0; j < m; ++j) above += sm.cnt[j] > k ? sm.mass[j] : 0ull;
    if (static_cast<double>(above) < target) {
      lo = min(lo, k);
      found = true;
    }
  }
  found = __syncthreads_or(found) != 0;
  uint32_t key;
  if (found) {
    key = block_min_u32(lo, sm);
  } else {  // target <= 0: the top group is kept (SPEC §6.7)
    uint32_t hi = 0;
    for (int32_t i = threadIdx.x; i < m; i += kThreads) hi = max(hi, sm.cnt[i]);
    key = ~block_min_u32(~hi, sm);
  }
  if (m == 0) key = kk;
  unsigned long long z = 0;
  for (int32_t i = threadIdx.x; i < m; i += kThreads) z += sm.cnt[i] >= key ? sm.mass[i] : 0ull;
  *key_out = key > kk ? key : kk;
  *z_out = block_sum(z, sm);
}

// The kept set of a row on the group path (one CTA per row, after its threshold `key` is known):
// the elements with score_key(s) >= key, written to ws.kept sorted by token when there are at
// most kKeptCap of them; ws.kept_n gets their number, else kKeptNone. Every kept element is a
// candidate (key >= the candidate bound's key), so with all n candidates' tokens in sm.tok
// (n <= kRankMax) they are taken from sm.keys / sm.tok; else the groups reaching the threshold
// are scanned again (their lines were just read). Whole CTA.
template <LogitsDtype D>
__device__ void write_kept(const VerifyChainParams& p, const Workspace& ws, int64_t row,
                           const char* rp, float inv_t, uint32_t key, uint32_t n, FilterSmem& sm) {
  const int warp = threadIdx.x / kWarp;
  uint32_t* tok = sm.cnt;              // [kKeptCap]
  uint32_t* kkey = sm.cnt + kKeptCap;  // [kKeptCap]
  if (threadIdx.x == 0) sm.kept = 0;
  __syncthreads();
  const auto keep = [&](uint32_t token, uint32_t kx) {
    const uint32_t pos = atomicAdd(&sm.kept, 1u);
    if (pos < static_cast<uint32_t>(kKeptCap)) {
      tok[pos] = token;
      kkey[pos] = kx;
    }
  };
  if (n <= static_cast<uint32_t>(kRankMax)) {
    for (uint32_t i = threadIdx.x; i < n; i += kThreads) {
      const uint32_t kx = sm.keys[i];
      if (kx >= key) keep(sm.tok[i], kx);
    }
  } else {
    const float t = key_to_float(key);  // score >= t as floats iff its key >= key (t > -inf)
    for (int s = 0; s < ws.nsplit; ++s) {
      scan_groups<D>(rp, p.vocab_size, s, ws.nsplit, group_max_of_chunk(ws, row, s, warp), t,
                     [&](int32_t v0, const float* x, auto cnt) {
                       constexpr int kN = decltype(cnt)::value;
#pragma unroll
                       for (int k = 0; k < kN; ++k) {
                         const uint32_t kx = score_key(sanitize_score(x[k] * inv_t));
                         if (kx >= key) keep(static_cast<uint32_t>(v0 + k), kx);
                       }
                     });
    }
  }
  __syncthreads();
  const uint32_t m = sm.kept;
  if (m <= static_cast<uint32_t>(kKeptCap)) {
    uint2* dst = ws.kept + row * kKeptCap;
    for (uint32_t i = threadIdx.x; i < m; i += kThreads) {  // rank by token (tokens distinct)
      const uint32_t ti = tok[i];
      uint32_t r = 0;
      for (uint32_t j = 0; j < m; ++j) r += tok[j] < ti;
      dst[r] = make_uint2(ti, kkey[i]);
    }
  }
  if (threadIdx.x == 0) ws.kept_n[row] = m <= static_cast<uint32_t>(kKeptCap) ? m : kKeptNone;
  __syncthreads();
}

// Exact threshold of one row from an enumerator (candidates or the whole row). Returns false when
// the candidates cannot decide (only for top-p without top-k: the cut might lie below them).
// Candidates in shared memory (SmemKeys, zero-padded to a multiple of 4) up to rank_max (<=
// kRankMax; 0 with PEAGLE_VERIFY_RADIX_SELECT=1) are selected by rank_select, more by radix digits.
template <typename Enum>
__device__ bool select_threshold(const Enum& en, int64_t num_elems, bool complete, int32_t top_k,
                                 float top_p, int32_t vocab, float ml, float zf, FilterSmem& sm,
                                 int32_t rank_max, uint32_t* key_out, unsigned long long* z_out) {
  const bool topk = top_k_active(top_k, vocab), topp = top_p_active(top_p);
  constexpr bool kSmem = std::is_same_v<Enum, SmemKeys>;
  if constexpr (kSmem) {
    if (en.n <= rank_max && topk && en.n >= top_k) {
      rank_select(en.keys, en.n, true, top_k, topp, top_p, -1.0, ml, sm, key_out, z_out);
      return true;
    }
  }
  uint32_t kk = 0;
  if (topk) kk = radix_kth_key(en, static_cast<uint32_t>(top_k), sm);
  if (!topp) {
    *key_out = kk;
    *z_out = kept_mass(en, kk, ml, sm);
    return true;
  }
  double target = -1.0;  // top-k kept mass times top_p, computed by radix_top_p
  if (!topk && !complete) {
    // top_p * Z from row_stats' normaliser; the candidates decide iff they hold >= target (then
    // the first non-candidate has mass >= target above it and is cut).
    target = static_cast<double>(top_p) * static_cast<double>(zf) * kMassScale;
    if (static_cast<double>(kept_mass(en, 0, ml, sm)) < target && num_elems < vocab) return false;
  }
  if constexpr (kSmem) {
    if (en.n <= rank_max) {
      rank_select(en.keys, en.n, topk, top_k, true, top_p, target, ml, sm, key_out, z_out);
      return true;
    }
  }
  radix_top_p(en, kk, ml, top_p, target, sm, key_out, z_out);
  return true;
}

// Whether row_stats' candidates of the row prove its threshold (every CTA of the row gets the same
// answer from the split metadata): *t_out gets T, *n_out the candidates of all splits. Warp 0.
__device__ __forceinline__ bool stats_cands_usable(const Workspace& ws, int64_t row, int32_t top_k,
                                                   uint32_t* t_out, uint32_t* n_out) {
  const int lane = threadIdx.x % kWarp;
  uint32_t t = 0, n = 0;
  bool bad = false;
  for (int s = lane; s < ws.nsplit; s += kWarp) {
    const TopkMeta mt = ws.topk_meta[row * ws.nsplit + s];
    bad |= mt.n == kStatsOverflow;
    t = max(t, mt.bound);
    n += mt.n == kStatsOverflow ? 0u : mt.n;
  }
#pragma unroll
  for (int d = kWarp / 2; d > 0; d >>= 1) {
    t = max(t, __shfl_xor_sync(0xffffffffu, t, d));
    n += __shfl_xor_sync(0xffffffffu, n, d);
  }
  bool full = false;  // a split with bound T and >= top_k candidates (all >= T)
  for (int s = lane; s < ws.nsplit; s += kWarp) {
    const TopkMeta mt = ws.topk_meta[row * ws.nsplit + s];
    full |= mt.n != kStatsOverflow && mt.bound == t && mt.n >= static_cast<uint32_t>(top_k);
  }
  bad = __any_sync(0xffffffffu, bad);
  full = __any_sync(0xffffffffu, full);
  *t_out = t;
  *n_out = n;
  return !bad && full && n <= static_cast<uint32_t>(kCandCap);
}

// 4 CTAs per SM (64 registers, a few spilled in the cold radix code): at B=64 the group path's
// 512 one-row CTAs fit one wave (3 per SM left a second), and B=1's streaming CTAs finish sooner.
template <LogitsDtype D, bool kCands = false>
__global__ void __launch_bounds__(kThreads, 4)
    row_filter_kernel(const VerifyChainParams p, const Workspace ws) {
  pdl_launch_dependents();
  __shared__ FilterSmem sm;
  __shared__ RowInfo s_info;
  __shared__ RowMerge s_row;
  const int split = blockIdx.x, nsplit = ws.nsplit;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  bool waited = false;
  for (int64_t row = blockIdx.y; row < p.num_rows; row += gridDim.y) {
    if (warp == 0) {
      const RowInfo info = row_info(p, row);  // inputs only: before the wait on row_stats
      if (lane == 0) s_info = info;
    }
    if (!waited) {
      pdl_wait();  // row_stats' partials and zeroed counters
      waited = true;
    }
    __syncthreads();
    const RowInfo info = s_info;
    bool from_stats = false;
    if constexpr (kCands) {
      if (stats_cands_row(ws, info, p.vocab_size)) {
        __shared__ uint32_t s_t, s_ok;
        if (warp == 0) {
          uint32_t t, n;
          const bool ok = stats_cands_usable(ws, row, info.top_k, &t, &n);
          if (lane == 0) {
            s_t = t;
            s_ok = ok;
          }
        }
        __syncthreads();
        from_stats = s_ok != 0;
        if (from_stats && split == 0) {
          const uint32_t t = s_t;
          if (warp == 0) {
            const RowMerge rm = warp_merge_row(ws.parts, nsplit, row);
            if (lane == 0) {
              s_row = rm;
              sm.n = 0;
            }
          }
          __syncthreads();
          const RowMerge rm = s_row;
          const float m = rm.idx < 0 ? -INFINITY : rm.m;
          // The candidates >= T: exactly the row's elements >= T (at most kCandCap).
          for (int s = 0; s < nsplit; ++s) {
            const uint32_t n = ws.topk_meta[row * nsplit + s].n;
            const uint32_t* src = ws.topk_cand + (row * nsplit + s) * kStatsCandCap;
            for (uint32_t i = threadIdx.x; i < n; i += kThreads) {
              const uint32_t k = src[i];
              if (k >= t) sm.keys[atomicAdd(&sm.n, 1u)] = k;
            }
          }
          __syncthreads();
          const uint32_t total = sm.n;
          pad_keys(sm, total);
          uint32_t key = 0;
          unsigned long long z = 0;
          select_threshold(SmemKeys{sm.keys, static_cast<int32_t>(total)}, total, true, info.top_k,
                           info.top_p, p.vocab_size, m * kLog2e, rm.z, sm, ws.rank_max, &key, &z);
          if (key < t) key = t;  // non-candidates below T stay cut
          if (threadIdx.x == 0) {
            RowStats st;
            st.m = m;
            st.key = key;
            st.z = static_cast<double>(z) / kMassScale;
            st.first_max = rm.idx < 0 ? 0 : rm.idx;
            ws.stats[row] = st;
          }
        }
      }
    }
    if (info.mode == kRowFiltered && !from_stats) {
      if (warp == 0) {
        const RowMerge rm = warp_merge_row(ws.parts, nsplit, row);
        if (lane == 0) {
          s_row = rm;
          sm.n = 0;
        }
      }
      __syncthreads();
      const RowMerge rm = s_row;
      const float m = rm.idx < 0 ? -INFINITY : rm.m;
      const float ml = m * kLog2e;
      float t;  // candidate bound (score)
      if (top_k_active(info.top_k, p.vocab_size)) {
        t = rm.bound;
      } else {
        const float denom = (1.0f - info.top_p) * rm.z;
        t = denom > 0.0f ? m - (logf(static_cast<float>(p.vocab_size) / denom) + 0.05f) : -INFINITY;
      }
      if (!(t > -INFINITY)) t = -INFINITY;   // NaN-safe
      const bool complete = t == -INFINITY;  // every element is a candidate
      const uint32_t key_t = score_key(t);
      const char* rp = row_ptr(p, row, Elem<D>::kSize);
      const float inv_t = info.inv_t;
      // Candidate iff score_key(score_of(x)) >= key_t, i.e. s >= t as floats (-0 == +0; a NaN
      // score is -inf, a candidate only when t = -inf). Keys are computed for candidates only.
      auto collect = [&](int32_t v0, const float* x, auto cnt) {
        constexpr int kN = decltype(cnt)::value;
        float s[kN];
        uint32_t c = 0;
#pragma unroll
        for (int k = 0; k < kN; ++k) {
          s[k] = x[k] * inv_t;
          c += complete || s[k] >= t;
        }
        if (c > 0) {  // rare: one shared atomic per thread and vector
          uint32_t pos = atomicAdd(&sm.n, c);
#pragma unroll
          for (int k = 0; k < kN; ++k) {
            if (complete || s[k] >= t) {
              if (pos < kCandCap) sm.keys[pos] = score_key(sanitize_score(s[k]));
              if (pos < kRankMax) sm.tok[pos] = static_cast<uint32_t>(v0 + k);
              ++pos;
            }
          }
        }
      };
      // One CTA per row (gridDim.x == 1, the group path): this CTA scans every split's share
      // and selects at once; else split `split` only, the row's last CTA to arrive selecting.
      const bool whole = gridDim.x == 1;
      const int s_end = whole ? nsplit : split + 1;
      for (int s = whole ? 0 : split; s < s_end; ++s) {
        // row_stats wrote the group maxima of this row unless it took the candidate branch.
        if (!kCands && ws.group_max != nullptr && !complete) {
          scan_groups<D>(rp, p.vocab_size, s, nsplit, group_max_of_chunk(ws, row, s, warp), t,
                         collect);
        } else {
          stream_split<D>(rp, p.vocab_size, s, nsplit, collect);
        }
      }
      __syncthreads();
      const uint32_t n = sm.n;
      uint32_t total = n, cap = static_cast<uint32_t>(kCandCap);
      bool last = true;
      uint32_t* dst = nullptr;
      if (!whole) {
        if (threadIdx.x == 0) sm.base = atomicAdd(ws.cand_count + row, n);  // may exceed cap
        __syncthreads();
        const uint32_t base = sm.base;
        cap = static_cast<uint32_t>(ws.cand_cap);  // <= kCandCap
        dst = ws.cand_keys + row * cap;
        for (uint32_t i = threadIdx.x; i < n && i < cap && base + i < cap; i += kThreads) {
          dst[base + i] = sm.keys[i];
        }
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) sm.last = atomicAdd(ws.filter_arrivals + row, 1u) == nsplit - 1u;
        __syncthreads();
        last = sm.last;
        if (last) {
          __threadfence();
          total = __ldcg(ws.cand_count + row);
        }
      }
      if (last) {
        uint32_t key = 0;
        unsigned long long z = 0;
        // (Fewer than k candidates cannot happen with a valid bound; fall back all the same.)
        bool ok = total <= cap && !(top_k_active(info.top_k, p.vocab_size) &&
                                    total < static_cast<uint32_t>(info.top_k));
        if (ok) {
          if (!whole) {
            for (uint32_t i = threadIdx.x; i < total; i += kThreads) sm.keys[i] = __ldcg(dst + i);
          }
          pad_keys(sm, total);
          ok = select_threshold(SmemKeys{sm.keys, static_cast<int32_t>(total)}, total, complete,
                                info.top_k, info.top_p, p.vocab_size, ml, rm.z, sm, ws.rank_max,
                                &key, &z);
          // The radix may stop at a bucket prefix below the exact threshold (no candidate lies in
          // between); non-candidates there must stay cut. The exact threshold is >= key_t.
          if (key < key_t) key = key_t;
        }
        if (!ok) {  // radix passes over the whole row
          __syncthreads();
          select_threshold(RowKeys<D>{rp, p.vocab_size, inv_t}, p.vocab_size, true, info.top_k,
                           info.top_p, p.vocab_size, ml, rm.z, sm, 0, &key, &z);
        }
        if (threadIdx.x == 0) {
          RowStats st;
          st.m = m;
          st.key = key;
          st.z = static_cast<double>(z) / kMassScale;
          st.first_max = rm.idx < 0 ? 0 : rm.idx;
          ws.stats[row] = st;
        }
        if (ws.kept_n != nullptr) {  // group path (whole): every filtered row writes kept_n
          if (ok && !complete) {
            write_kept<D>(p, ws, row, rp, inv_t, key, total, sm);
          } else if (threadIdx.x == 0) {
            ws.kept_n[row] = kKeptNone;
          }
        }
      }
    }
    __syncthreads();
  }
  if (!waited) pdl_wait();
}

}  // namespace
}  // namespace peagle
