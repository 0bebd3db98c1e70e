// CUDA verify_chain (torch-free): chain verification straight from the target logits.
// Semantics: peagle/kernels/verify_chain.h (shared with the CPU op). Two or three kernels on one
// stream, no host synchronisation, graph-capturable; the later kernels are programmatic dependent
// launches (their CTAs are scheduled during the previous kernel's tail and load their inputs
// there, then wait for its completion before reading its outputs):
//
//   1. row_stats (verify_chain_stats.cuh) grid (S, R): every logits row read once; per split the
//      first-index argmax and, for random rows, the online normaliser. Zeroes the counters.
//   2. row_filter (verify_chain_filter.cuh; only with top_k / top_p tensors) grid (S, R):
//      candidate keys above a provable bound, then the exact threshold and kept mass by the last
//      CTA of each row.
//   3. decide_sample (below) grid (S2, B): every CTA of request r evaluates r's acceptance chain
//      (cheap: one merged partial per row, one logit per draft); CTA 0 writes the outputs; if a
//      token must be sampled (random request: recovered or bonus token), it is drawn by
//      inverse-CDF sampling (one Philox draw per request):
//      * chunk sampling (S2 = 1; without top-k/top-p, draft_probs and exponentials): row_stats
//        left every warp's normaliser over its contiguous chunk of the row, so the one CTA finds
//        the draw's chunk from those masses and reads only that chunk (plus the chunk of an
//        excluded draft, recomputed without it);
//      * otherwise the S2 CTAs compute the masses of the sampled row's 2048-token tiles, and the
//        last one to finish (arrival counter) draws the token.
//
// Inverse-CDF sampling needs one Philox draw and one weight per token (one FFMA + one MUFU.EX2),
// so a sampled row costs one more read of that row and no per-token noise. All reductions run in
// a fixed order (or are integer), so results are bit-identical run to run.
#include <cstdlib>

#include "launch.cuh"
#include "verify_chain_common.cuh"
#include "verify_chain_filter.cuh"
#include "verify_chain_heuristics.h"
#include "verify_chain_stats.cuh"

namespace peagle {
namespace {

constexpr int kChunk = 32;                 // decide: rows evaluated at a time
constexpr int kTileTokens = 8 * kThreads;  // sample: inverse-CDF tile, 8 tokens per thread
constexpr int kTilesInFlight = 4;          // sample: tiles loaded together per CTA (level A)
constexpr int kChunkRound = 5;             // chunk sampling: tiles held in registers per round
                                           // (3 for fp32 logits: kRoundTiles)
constexpr int kSampleCtasPerSm = 3;        // tiled decide_sample residency from 32 requests
constexpr int kChunkCtasPerSm = 2;         // ... with chunk sampling
constexpr int kFusedTilesInFlight = 2;     // fused_kernel's sampling items (64 registers)
constexpr int kMinStatsElems = 4096;       // row_stats / row_filter: at least this many per CTA

enum : int32_t { kModeDone = 0, kModeRecovered = 1, kModeBonus = 2 };

struct RowDistGpu {
  float m;
  uint32_t key;  // kept iff score_key(s) >= key
  double z;
  int32_t first_max;
};

struct ReqSmem {  // per-request inputs, loaded before the wait on the previous kernel
  int64_t first_draft, first_row;
  int64_t seed, offset;
  int32_t n, num_drafts;
  int32_t real, greedy, filtered;
  float inv_t;
  int32_t x[kChunk];  // drafts of the current chunk
  float sx[kChunk];   // their scores at their rows (random requests)
  float qx[kChunk];   // draft probabilities (1 without draft_probs; 0 for invalid ids)
  double u[kChunk];   // acceptance uniforms
};

struct DecideSmem {
  int32_t tok[kChunk];  // greedy: argmax of the row
  int32_t acc[kChunk];  // draft rows: accepted?
  RowDistGpu dist[kChunk];
  int32_t first_reject;
  Decision dec;
};

struct SampleSmem {
  double warp_tot[kWarps];
  double tile_part[kWarps][kTilesInFlight];  // level A: per-warp sums of the tiles in flight
  double t_rem;   // level B: the target inside the chosen tile (+inf: take its last token)
  int64_t tile;   // level B: the chosen tile (chunk sampling: first the chosen chunk)
  int32_t chunk;  // chunk sampling: the chunk holding the excluded draft
  ArgMax warp_best[kWarps];
  int32_t owner_lo, owner_hi;
  int32_t last;
  float round_part[kChunkRound][kWarps];  // chunk sampling: every warp's total per tile
  int32_t first_lane[kWarps], last_lane[kWarps];
};

// ---- inputs of one request (before the wait)
// ------------------------------------------------------

// Drafts [c0, c0 + kChunk) of the request: ids, scores at their rows, q(x), uniforms. Whole CTA.
__device__ void load_chunk(const VerifyChainParams& p, ReqSmem& rs, int32_t c0) {
  const int j = threadIdx.x;
  if (j < kChunk && c0 + j < rs.n) {
    const int32_t jj = c0 + j;
    const int64_t draft_index = rs.first_draft + jj;
    const int32_t x = p.draft_token_ids[draft_index];
    rs.x[j] = x;
    if (!rs.greedy) {
      const bool valid = x >= 0 && x < p.vocab_size;
      const int64_t row = rs.first_row + jj;
      rs.sx[j] = valid
                     ? score_of(load_logit(p.logits, p.logits_dtype, row * p.logits_row_stride + x),
                                rs.inv_t)
                     : -INFINITY;
      float q = 1.0f;
      if (p.draft_probs != nullptr) {
        q = valid ? p.draft_probs[draft_index * p.draft_probs_row_stride + x] : 0.0f;
      }
      rs.qx[j] = q;
      rs.u[j] = p.uniforms != nullptr
                    ? p.uniforms[draft_index]
                    : acceptance_uniform(rs.seed, rs.offset, static_cast<uint32_t>(jj));
    }
  }
  __syncthreads();
}

// The per-request scalars (thread 0), then a barrier. Whole CTA.
__device__ void load_request_head(const VerifyChainParams& p, int32_t r, ReqSmem& rs) {
  if (threadIdx.x == 0) {
    const RequestSpan span = request_span(p.cu_num_draft_tokens, r, p.num_draft_tokens);
    rs.first_draft = span.first_draft;
    rs.first_row = span.first_row;
    rs.num_drafts = span.num_drafts;
    rs.n = min(span.num_drafts, p.max_num_draft_tokens);
    rs.real = request_is_real(p, r);
    const float t = rs.real ? p.temperature[r] : 0.0f;
    rs.greedy = is_greedy_temperature(t);
    rs.filtered = rs.real && !rs.greedy && request_is_filtered(p, r);
    rs.inv_t = rs.greedy ? 1.0f : inverse_temperature(t);
    rs.seed = rs.real ? p.seeds[r] : 0;
    rs.offset = rs.real ? p.offsets[r] : 0;
  }
  __syncthreads();
}

__device__ void load_request(const VerifyChainParams& p, int32_t r, ReqSmem& rs) {
  load_request_head(p, r, rs);
  if (rs.real) load_chunk(p, rs, 0);
}

// ---- 3a. acceptance chain (after the wait) ----------------------------------------------------

__device__ int32_t row_argmax_gpu(const Workspace& ws, int64_t row) {
  const int lane = threadIdx.x % kWarp;
  ArgMax a = argmax_none();
  for (int s = lane; s < ws.nsplit; s += kWarp) {
    const RowPartial q = load_part(ws.parts + row * ws.nsplit + s);
    a = argmax_merge(a, ArgMax{q.m, q.idx});
  }
  a = warp_argmax(a);
  const int32_t idx = __shfl_sync(0xffffffffu, a.idx, 0);
  return idx < 0 ? 0 : idx;
}

__device__ RowDistGpu row_dist(const Workspace& ws, int64_t row, bool filtered) {
  RowDistGpu d;
  if (filtered) {
    const RowStats st = ws.stats[row];
    d.m = st.m;
    d.key = st.key;
    d.z = st.z;
    d.first_max = st.first_max;
    return d;
  }
  const RowMerge rm = warp_merge_row(ws.parts, ws.nsplit, row);
  d.m = rm.idx < 0 ? -INFINITY : rm.m;
  d.key = 0;
  d.z = static_cast<double>(rm.z);
  d.first_max = rm.idx < 0 ? 0 : rm.idx;
  return d;
}

// Whole CTA: warp w evaluates rows w, w + 8, ... of a chunk of up to 32 rows in parallel, then
// thread 0 finds the first rejection; later chunks only if the whole chunk was accepted.
__device__ void decide(const VerifyChainParams& p, const Workspace& ws, int32_t r, ReqSmem& rs,
                       DecideSmem& ds) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int32_t n = rs.n;
  if (threadIdx.x == 0) {
    Decision dec;
    dec.mode = kModeDone;
    dec.accepted = 0;
    dec.exclude = -1;
    dec.exclude_score = -INFINITY;
    dec.first_max = 0;
    dec.last = kPlaceholderTokenId;
    dec.row = 0;
    dec.q_row = -1;
    dec.m = 0.0f;
    dec.zf = 1.0f;
    dec.key = 0;
    ds.dec = dec;
  }
  for (int32_t c0 = 0; c0 <= n; c0 += kChunk) {
    if (c0 > 0) load_chunk(p, rs, c0);
    const int32_t c1 = min(c0 + kChunk, n + 1);
    for (int32_t j = c0 + warp; j < c1; j += kWarps) {
      // Row j < n: draft row; j == n: the bonus row.
      const int64_t row = rs.first_row + (j < n ? j : rs.num_drafts);
      int32_t acc = 0;
      if (j == n && p.bonus_token_ids != nullptr) {
        // The bonus token is given: its row was skipped by row_stats and is never read.
      } else if (rs.greedy) {
        const int32_t a = row_argmax_gpu(ws, row);
        acc = j < n && rs.x[j - c0] == a;
        if (lane == 0) ds.tok[j - c0] = a;
      } else {
        const RowDistGpu d = row_dist(ws, row, rs.filtered);
        if (lane == 0) {
          ds.dist[j - c0] = d;
          if (j < n) {
            const int32_t x = rs.x[j - c0];
            const float s = rs.sx[j - c0];
            double p_x = 0.0;
            if (x >= 0 && x < p.vocab_size && score_key(s) >= d.key) {
              p_x = kept_target_prob(s, d.m, d.z, x, d.first_max);
            }
            acc = accept_draft(rs.u[j - c0], p_x, static_cast<double>(rs.qx[j - c0]));
          }
        }
      }
      if (lane == 0) ds.acc[j - c0] = acc;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int32_t fr = -1;
      for (int32_t j = c0; j < min(c1, n); ++j) {
        if (!ds.acc[j - c0]) {
          fr = j;
          break;
        }
      }
      ds.first_reject = fr;
      if (fr >= 0 || c1 == n + 1) {
        const int32_t j = fr >= 0 ? fr : n;  // the row that yields the last token
        Decision dec = ds.dec;
        dec.accepted = j;
        if (fr < 0 && p.bonus_token_ids != nullptr) {
          dec.last = p.bonus_token_ids[r];  // mode stays kModeDone
        } else if (rs.greedy) {
          dec.last = ds.tok[j - c0];
        } else {
          const RowDistGpu d = ds.dist[j - c0];
          dec.mode = fr >= 0 ? kModeRecovered : kModeBonus;
          dec.row = rs.first_row + (fr >= 0 ? fr : rs.num_drafts);
          dec.exclude = fr >= 0 && p.draft_probs == nullptr ? rs.x[fr - c0] : -1;
          dec.exclude_score = fr >= 0 ? rs.sx[fr - c0] : -INFINITY;
          dec.q_row = fr >= 0 && p.draft_probs != nullptr ? rs.first_draft + fr : -1;
          dec.m = d.m;
          dec.key = d.key;
          dec.zf = static_cast<float>(d.z);
          dec.first_max = d.first_max;
        }
        ds.dec = dec;
      }
    }
    __syncthreads();
    const bool done = ds.first_reject >= 0 || c1 == n + 1;
    __syncthreads();
    if (done) break;
  }
}

// CTA 0 of the request: the accepted prefix, the final token unless it is sampled, -1 padding,
// the counters. Whole CTA.
__device__ void write_outputs(const VerifyChainParams& p, int32_t r, bool real,
                              const Decision& dec) {
  const int64_t width = p.max_num_draft_tokens + 1;
  const int32_t accepted = real ? dec.accepted : 0;
  int32_t* out = p.output_token_ids + r * width;
  const int64_t first_draft =
      request_span(p.cu_num_draft_tokens, r, p.num_draft_tokens).first_draft;
  for (int64_t c = threadIdx.x; c < width; c += kThreads) {
    int32_t v = kPlaceholderTokenId;
    if (real && c < accepted) v = p.draft_token_ids[first_draft + c];
    if (real && c == accepted) {
      if (dec.mode != kModeDone) continue;  // written by the last sampling CTA
      v = dec.last;
    }
    out[c] = v;
  }
  if (p.accepted_per_position != nullptr) {
    bool* app = p.accepted_per_position + r * static_cast<int64_t>(p.max_num_draft_tokens);
    for (int64_t c = threadIdx.x; c < p.max_num_draft_tokens; c += kThreads) app[c] = c < accepted;
  }
  if (threadIdx.x == 0) p.num_accepted[r] = accepted;
}

// ---- 3b. sampling ------------------------------------------------------------------------------
//
// Recovered / bonus tokens (Philox mode) by inverse-CDF sampling in vocabulary order. The row is
// cut into tiles of kTileTokens; thread i of a tile owns its tokens [8i, 8i + 8). Level A: the
// request's CTAs compute the tile masses (fp64) in parallel. Level B (the last CTA to arrive):
// t = u * W; the tile holding t is found from the tile masses, then the token inside it from the
// tile's per-thread sums, recomputed with the same arithmetic. The search takes the first owner
// whose (prefix + own mass) exceeds the target and falls back to the last token with weight, so a
// rounding mismatch between levels can only move the draw to a neighbouring token with weight.

// The 4 logits of group g (tokens 4g .. 4g+3; -inf past the vocabulary).
template <LogitsDtype D>
__device__ __forceinline__ void load_group(const char* rp, int64_t g, int32_t vocab, bool aligned,
                                           float x[4]) {
  const int64_t v0 = 4 * g;
  if (aligned && v0 + 4 <= vocab) {
    if constexpr (D == LogitsDtype::kFloat32) {
      const uint4 w = ld_stream16(rp + v0 * 4);
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
      unpack_words<D, 4>(words, x);
    } else {
      const uint2 w = ld_stream8(rp + v0 * 2);
      const uint32_t words[2] = {w.x, w.y};
      unpack_words<D, 2>(words, x);
    }
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) x[k] = v0 + k < vocab ? load_scalar<D>(rp, v0 + k) : -INFINITY;
  }
}

struct SampleRow {  // everything a token's sampling weight depends on
  const char* rp;
  const float* q;  // draft_probs row (residual) or null
  float inv_t, ml, zf;
  uint32_t key;  // kept iff score_key(s) >= key (0 keeps all)
  int32_t exclude;
  int32_t vocab;
  int32_t lo, hi;  // only tokens in [lo, hi) have weight: the row, or one chunk of it
  int64_t base;    // first token of tile 0 (a multiple of 8)
  int64_t ntiles;  // tiles of kTileTokens from base covering [lo, hi)
  bool aligned;
};

// The 8 logits from v0 (a multiple of 4); -inf past the vocabulary.
template <LogitsDtype D>
__device__ __forceinline__ void load_tokens(const SampleRow& sr, int64_t v0, float x[8]) {
  load_group<D>(sr.rp, v0 / 4, sr.vocab, sr.aligned, x);
  load_group<D>(sr.rp, v0 / 4 + 1, sr.vocab, sr.aligned, x + 4);
}

struct Weights8 {  // 8 floats passed by value, so an out-of-line call keeps them in registers
  float v[8];
};

// Weights of the 8 tokens from v0 given their logits: e_v for kept v != exclude, or the residual
// max(e_v / Z - q_v, 0); 0 outside [lo, hi) and for NaN / -inf scores. Out of line: the chunk
// sampler reaches this from ~10 unrolled sites, and inlined copies (each with an IEEE division)
// made its chain wait to fetch its own code (docs/architecture.md, verify_chain code size).
__device__ __noinline__ Weights8 weights_of8(const SampleRow sr, int64_t v0, const Weights8 x) {
  Weights8 w;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const int64_t v = v0 + k;
    float wk = 0.0f;
    if (v >= sr.lo && v < sr.hi) {
      const float s = x.v[k] * sr.inv_t;
      const bool kept = score_key(s) >= sr.key;
      if (sr.q == nullptr) {
        if (kept && v != sr.exclude) wk = fast_weight(s, sr.ml);
      } else {
        const float res = (kept ? fast_weight(s, sr.ml) / sr.zf : 0.0f) - __ldg(sr.q + v);
        wk = res > 0.0f ? res : 0.0f;
      }
    }
    w.v[k] = wk;
  }
  return w;
}

__device__ __forceinline__ void weights_of(const SampleRow& sr, int64_t v0, const float x[8],
                                           float w[8]) {
  Weights8 in;
#pragma unroll
  for (int k = 0; k < 8; ++k) in.v[k] = x[k];
  const Weights8 out = weights_of8(sr, v0, in);
#pragma unroll
  for (int k = 0; k < 8; ++k) w[k] = out.v[k];
}

template <LogitsDtype D>
__device__ __forceinline__ void token_weights(const SampleRow& sr, int64_t v0, float w[8]) {
  float x[8];
  load_tokens<D>(sr, v0, x);
  weights_of(sr, v0, x, w);
}

// Block-wide exclusive scan of one fp64 value per thread in thread order (fixed order, so the same
// inputs give the same bits). Whole CTA.
__device__ __forceinline__ void block_excl_scan(double v, double& excl, double& total,
                                                SampleSmem& ss) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  double inc = v;
#pragma unroll
  for (int d = 1; d < kWarp; d <<= 1) {
    const double n = __shfl_up_sync(0xffffffffu, inc, d);
    if (lane >= d) inc += n;
  }
  if (lane == kWarp - 1) ss.warp_tot[warp] = inc;
  const double prev = __shfl_up_sync(0xffffffffu, inc, 1);
  __syncthreads();
  double off = 0.0, tot = 0.0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    if (w == warp) off = tot;
    tot += ss.warp_tot[w];
  }
  excl = lane == 0 ? off : off + prev;
  total = tot;
  __syncthreads();
}

// The lowest thread with `first` set, else the highest with `any` set, else -1. Whole CTA.
__device__ __forceinline__ int32_t pick_owner(bool first, bool any, SampleSmem& ss) {
  if (threadIdx.x == 0) {
    ss.owner_lo = kThreads;
    ss.owner_hi = -1;
  }
  __syncthreads();
  if (first) atomicMin(&ss.owner_lo, static_cast<int32_t>(threadIdx.x));
  if (any) atomicMax(&ss.owner_hi, static_cast<int32_t>(threadIdx.x));
  __syncthreads();
  const int32_t o = ss.owner_lo < kThreads ? ss.owner_lo : ss.owner_hi;
  __syncthreads();
  return o;
}

__device__ __forceinline__ ArgMax ldcg_argmax(const ArgMax* a) {
  ArgMax out;
  out.val = __ldcg(&a->val);
  out.idx = __ldcg(&a->idx);
  return out;
}

// Thread 0 publishes this CTA's share of request r; true in every thread of the last CTA to
// arrive (which then sees every other CTA's share). Whole CTA.
__device__ __forceinline__ bool arrive_last(const Workspace& ws, int32_t r, SampleSmem& ss) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    ss.last = atomicAdd(ws.sample_arrivals + r, 1u) == static_cast<uint32_t>(ws.nsample - 1);
    if (ss.last && ws.decided != nullptr) {
      // Fused path: every sampling item of r has read its decision; leave the counters zeroed.
      ws.sample_arrivals[r] = 0;
      ws.decided[r] = 0;
    }
  }
  __syncthreads();
  const bool last = ss.last;
  if (last) __threadfence();
  return last;
}

__device__ __forceinline__ void write_sampled(const VerifyChainParams& p, int32_t r,
                                              const Decision& dec, int32_t tok) {
  p.output_token_ids[static_cast<int64_t>(r) * (p.max_num_draft_tokens + 1) + dec.accepted] = tok;
}

// Inverse CDF over n masses mass(i) >= 0 summed in a fixed order (thread i: a contiguous segment
// of indices, then a block scan). With `have_t` false the target is t = u * total with the
// request's draw. Leaves in ss.tile the first index whose running sum passes t and in ss.t_rem
// the target inside it; if none does (t >= total by rounding), the last index with mass and
// t_rem = +inf. Returns false (the total is not > 0). Whole CTA, uniform result.
template <typename MassFn>
__device__ bool pick_mass(int64_t n, MassFn mass, double t, bool have_t, const ReqSmem& rs,
                          const Decision& dec, SampleSmem& ss) {
  const int64_t per = (n + kThreads - 1) / kThreads;
  const int64_t c0 = min(n, per * threadIdx.x), c1 = min(n, c0 + per);
  double seg = 0.0;
  for (int64_t c = c0; c < c1; ++c) seg += mass(c);
  double excl, total;
  block_excl_scan(seg, excl, total, ss);
  if (!(total > 0.0)) return false;  // empty residual (or no finite score)
  if (!have_t) {
    const uint32_t stream = dec.mode == kModeBonus ? kStreamBonus : kStreamRecovered;
    t = sampling_uniform(rs.seed, rs.offset, stream) * total;
  }
  const int32_t o = pick_owner(seg > 0.0 && excl + seg > t, seg > 0.0, ss);
  if (static_cast<int32_t>(threadIdx.x) == o) {
    const bool found = excl + seg > t;
    double part = 0.0;
    int64_t idx = -1;
    double t_rem = INFINITY;
    for (int64_t c = c0; c < c1; ++c) {
      const double m = mass(c);
      if (!(m > 0.0)) continue;
      const double before = part;
      part += m;
      idx = c;
      if (found && excl + part > t) {
        t_rem = t - (excl + before);
        break;
      }
    }
    ss.tile = idx;
    ss.t_rem = found ? t_rem : INFINITY;
  }
  __syncthreads();
  return true;
}

// Level B (last CTA): the token at the target (t = u * W unless `have_t`) over sr's tiles, whose
// masses are in ws.tile_mass. Whole CTA.
template <LogitsDtype D>
__device__ void cdf_pick(const VerifyChainParams& p, const Workspace& ws, int32_t r,
                         const ReqSmem& rs, const Decision& dec, const SampleRow& sr,
                         SampleSmem& ss, double t = 0.0, bool have_t = false) {
  const double* mass = ws.tile_mass + static_cast<int64_t>(r) * ws.tiles_per_req;
  if (!pick_mass(sr.ntiles, [&](int64_t c) { return __ldcg(mass + c); }, t, have_t, rs, dec, ss)) {
    if (threadIdx.x == 0) write_sampled(p, r, dec, dec.first_max);
    return;
  }
  __syncthreads();
  const int64_t tile = ss.tile;
  const double t_rem = ss.t_rem;
  // Inside the tile: this thread's 8 tokens, their running sum, the tile's prefix over threads.
  const int64_t v0 = sr.base + tile * kTileTokens + 8 * static_cast<int64_t>(threadIdx.x);
  float w[8], part[8];
  token_weights<D>(sr, v0, w);
  float run = 0.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    run += w[k];
    part[k] = run;
  }
  double excl2, total2;
  block_excl_scan(static_cast<double>(run), excl2, total2, ss);
  (void)total2;
  const int32_t o =
      pick_owner(run > 0.0f && excl2 + static_cast<double>(run) > t_rem, run > 0.0f, ss);
  if (static_cast<int32_t>(threadIdx.x) == o) {
    // First token whose running sum passes the target, else (fallback owner) the last with weight.
    int32_t tok = -1, last_tok = -1;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      if (w[k] > 0.0f) {
        last_tok = static_cast<int32_t>(v0 + k);
        if (tok < 0 && excl2 + static_cast<double>(part[k]) > t_rem) tok = last_tok;
      }
    }
    write_sampled(p, r, dec, tok >= 0 ? tok : last_tok);
  }
}

// Level A: the masses of sr's tiles first, first + step, ... (kInFlight loaded together per
// round, so a CTA keeps several 4 KB tiles in flight) into mass[]; per tile the thread sums are
// reduced across each warp (fixed shuffle tree) and then over the warps in order. Whole CTA;
// ends with a barrier.
template <LogitsDtype D, int kInFlight>
__device__ void tile_masses(const SampleRow& sr, int64_t first, int64_t step, double* mass,
                            SampleSmem& ss) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t lane_tok = sr.base + 8 * static_cast<int64_t>(threadIdx.x);
  for (int64_t c0 = first; c0 < sr.ntiles; c0 += step * kInFlight) {
    float x[kInFlight][8];
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      const int64_t c = c0 + i * step;
      if (c < sr.ntiles) load_tokens<D>(sr, lane_tok + c * kTileTokens, x[i]);
    }
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      const int64_t c = c0 + i * step;
      double run = 0.0;
      if (c < sr.ntiles) {
        float w[8];
        weights_of(sr, lane_tok + c * kTileTokens, x[i], w);
        float f = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) f += w[k];
        run = f;
      }
#pragma unroll
      for (int d = kWarp / 2; d > 0; d >>= 1) run += __shfl_xor_sync(0xffffffffu, run, d);
      if (lane == 0) ss.tile_part[warp][i] = run;
    }
    __syncthreads();
    if (threadIdx.x < kInFlight) {
      const int64_t c = c0 + static_cast<int64_t>(threadIdx.x) * step;
      if (c < sr.ntiles) {
        double tot = 0.0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) tot += ss.tile_part[w][threadIdx.x];
        mass[c] = tot;
      }
    }
    __syncthreads();
  }
}

// Narrows sr to chunk c (chunk_range) of its row: tiles of kTileTokens from the chunk's first
// token rounded down to a multiple of 8.
template <LogitsDtype D>
__device__ __forceinline__ void narrow_to_chunk(SampleRow& sr, const RowBody& b, int nsplit,
                                                int32_t c) {
  const ChunkRange cr = chunk_range<D>(b, sr.vocab, c / kWarps, nsplit, c % kWarps);
  sr.lo = cr.lo;
  sr.hi = cr.hi;
  sr.base = cr.lo & ~7;
  sr.ntiles = sr.hi > sr.base ? (sr.hi - sr.base + kTileTokens - 1) / kTileTokens : 0;
}

// The logits of 8 tokens as D's raw words (4 for 16-bit types, 8 for fp32): exact, the values
// came from D (-inf included), so unpack_words<D> gives them back.
template <LogitsDtype D>
constexpr int kTokWords = D == LogitsDtype::kFloat32 ? 8 : 4;

template <LogitsDtype D>
__device__ __forceinline__ void pack_words(const float x[8], uint32_t* w) {
#pragma unroll
  for (int i = 0; i < kTokWords<D>; ++i) {
    if constexpr (D == LogitsDtype::kFloat32) {
      w[i] = __float_as_uint(x[i]);
    } else if constexpr (D == LogitsDtype::kBFloat16) {
      w[i] = (__float_as_uint(x[2 * i]) >> 16) | (__float_as_uint(x[2 * i + 1]) & 0xffff0000u);
    } else {
      w[i] = static_cast<uint32_t>(__half_as_ushort(__float2half_rn(x[2 * i]))) |
             (static_cast<uint32_t>(__half_as_ushort(__float2half_rn(x[2 * i + 1]))) << 16);
    }
  }
}

// The 8 logits from v0 (a multiple of 8) as raw words (-inf past the vocabulary).
template <LogitsDtype D>
__device__ __forceinline__ void load_words(const SampleRow& sr, int64_t v0, uint32_t* w) {
  if (sr.aligned && v0 + 8 <= sr.vocab) {
    const char* src = sr.rp + v0 * Elem<D>::kSize;
    if constexpr (D == LogitsDtype::kFloat32) {
      const uint4 a = ld_stream16(src), b = ld_stream16(src + 16);
      w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w;
      w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
    } else {  // 8-byte alignment only (aligned: the row starts at a multiple of 4 elements)
      const uint2 a = ld_stream8(src), b = ld_stream8(src + 8);
      w[0] = a.x, w[1] = a.y, w[2] = b.x, w[3] = b.y;
    }
  } else {
    float x[8];
#pragma unroll
    for (int k = 0; k < 8; ++k)
      x[k] = v0 + k < sr.vocab ? load_scalar<D>(sr.rp, v0 + k) : -INFINITY;
    pack_words<D>(x, w);
  }
}

// One round of a chunk's tiles (thread i owns tokens [8i, 8i + 8) of each, as in cdf_pick), held
// in registers: the logits (raw words: fewer registers than weights; the owner of the draw
// recomputes its 8 weights), the thread's sum of its 8 weights (token order) and the inclusive
// warp scan of those sums (fixed shuffle order).
template <LogitsDtype D>
constexpr int kRoundTiles = D == LogitsDtype::kFloat32 ? 3 : kChunkRound;

template <LogitsDtype D>
struct ChunkRound {
  uint32_t words[kRoundTiles<D>][kTokWords<D>];
  float own[kRoundTiles<D>];
  float incl[kRoundTiles<D>];
};

// Loads tiles t0 .. t0 + kRoundTiles<D> - 1 of sr (all in flight together) into cr; every warp's
// total per tile goes to ss.round_part (0 past the last tile). Whole CTA; ends with a barrier.
// The caller separates two calls by a barrier (the totals are overwritten).
template <LogitsDtype D>
__device__ __forceinline__ void load_round(const SampleRow& sr, int64_t t0, ChunkRound<D>& cr,
                                           SampleSmem& ss) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t lane_tok = sr.base + 8 * static_cast<int64_t>(threadIdx.x);
#pragma unroll
  for (int i = 0; i < kRoundTiles<D>; ++i) {
    if (t0 + i < sr.ntiles) load_words<D>(sr, lane_tok + (t0 + i) * kTileTokens, cr.words[i]);
  }
#pragma unroll
  for (int i = 0; i < kRoundTiles<D>; ++i) {
    float f = 0.0f;
    if (t0 + i < sr.ntiles) {
      float x[8], w[8];
      unpack_words<D, kTokWords<D>>(cr.words[i], x);
      weights_of(sr, lane_tok + (t0 + i) * kTileTokens, x, w);
#pragma unroll
      for (int k = 0; k < 8; ++k) f += w[k];
    }
    cr.own[i] = f;
    float inc = f;
#pragma unroll
    for (int d = 1; d < kWarp; d <<= 1) {
      const float n = __shfl_up_sync(0xffffffffu, inc, d);
      if (lane >= d) inc += n;
    }
    cr.incl[i] = inc;
    if (lane == kWarp - 1) ss.round_part[i][warp] = inc;
  }
  __syncthreads();
}

// Tile i's mass of the loaded round: the warps' totals in warp order (fp64).
__device__ __forceinline__ double round_mass(const SampleSmem& ss, int i) {
  double m = 0.0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) m += static_cast<double>(ss.round_part[i][w]);
  return m;
}

// Writes the token at target t (fp64, from the start of tile i of the loaded round, whose first
// token is `tile_tok`): the lowest thread with weight whose prefix (its warp's offset + its
// inclusive scan) passes t, then its first token whose running sum does; if no thread's prefix
// passes t (t at or past the tile's mass: rounding, or t = +inf), the tile's last token with
// weight; a thread whose running sums fall short of t by rounding takes its last token with
// weight. Nothing is written if the tile has no weight. Whole CTA.
template <LogitsDtype D>
__device__ __forceinline__ void pick_in_tile(const VerifyChainParams& p, int32_t r,
                                             const Decision& dec, const SampleRow& sr,
                                             const ChunkRound<D>& cr, int i, int64_t tile_tok,
                                             double t, SampleSmem& ss) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  uint32_t words[kTokWords<D>];
  float own = 0.0f, incl = 0.0f;
#pragma unroll
  for (int j = 0; j < kRoundTiles<D>; ++j) {  // register arrays: no dynamic index
    if (j == i) {
#pragma unroll
      for (int k = 0; k < kTokWords<D>; ++k) words[k] = cr.words[j][k];
      own = cr.own[j];
      incl = cr.incl[j];
    }
  }
  double woff = 0.0;
  for (int v = 0; v < warp; ++v) woff += static_cast<double>(ss.round_part[i][v]);
  const float prev = __shfl_up_sync(0xffffffffu, incl, 1);
  const double excl = woff + static_cast<double>(lane == 0 ? 0.0f : prev);
  const unsigned cross =
      __ballot_sync(0xffffffffu, own > 0.0f && woff + static_cast<double>(incl) > t);
  const unsigned any = __ballot_sync(0xffffffffu, own > 0.0f);
  if (lane == 0) {
    ss.first_lane[warp] = cross ? __ffs(static_cast<int>(cross)) - 1 : -1;
    ss.last_lane[warp] = any ? kWarp - 1 - __clz(static_cast<int>(any)) : -1;
  }
  __syncthreads();
  int32_t o = -1, hi = -1;
#pragma unroll
  for (int v = 0; v < kWarps; ++v) {
    if (o < 0 && ss.first_lane[v] >= 0) o = v * kWarp + ss.first_lane[v];
    if (ss.last_lane[v] >= 0) hi = v * kWarp + ss.last_lane[v];
  }
  const bool found = o >= 0;
  if (static_cast<int32_t>(threadIdx.x) == (found ? o : hi)) {
    const int64_t v0 = tile_tok + 8 * static_cast<int64_t>(threadIdx.x);
    float x[8], w[8];
    unpack_words<D, kTokWords<D>>(words, x);
    weights_of(sr, v0, x, w);
    float part = 0.0f;
    int tok = -1, last = -1;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      part += w[k];
      if (w[k] > 0.0f) {
        last = k;
        if (found && tok < 0 && excl + static_cast<double>(part) > t) tok = k;
      }
    }
    write_sampled(p, r, dec, static_cast<int32_t>(v0 + (tok >= 0 ? tok : last)));
  }
}

// The mass of chunk sr: its tile masses (load_round, round_mass) summed in tile order, the same
// fp64 sums chunk_pick accumulates. Whole CTA; ends with a barrier.
template <LogitsDtype D>
__device__ double chunk_mass(const SampleRow& sr, SampleSmem& ss) {
  double acc = 0.0;
  ChunkRound<D> cr;
  for (int64_t t0 = 0; t0 < sr.ntiles; t0 += kRoundTiles<D>) {
    if (t0 > 0) __syncthreads();
    load_round<D>(sr, t0, cr, ss);
#pragma unroll
    for (int i = 0; i < kRoundTiles<D>; ++i) acc += round_mass(ss, i);
  }
  __syncthreads();
  return acc;
}

// Level 2 of chunk sampling: writes the token at target t (fp64, from the chunk's start) in chunk
// sr. Round by round (kRoundTiles<D> tiles each, usually one round): the tile holding t from the
// tile masses, then the token from the registers (pick_in_tile) -- one read of the chunk. If t
// is at or past the chunk's mass (level 1's fp32 masses vs these sums, or t = +inf), the
// chunk's last token with weight; with no weight at all, the row's first maximum. Whole CTA.
template <LogitsDtype D>
__device__ void chunk_pick(const VerifyChainParams& p, int32_t r, const Decision& dec,
                           const SampleRow& sr, double t, SampleSmem& ss) {
  double acc = 0.0;
  int64_t last_tile = -1;
  ChunkRound<D> cr;
  for (int64_t t0 = 0; t0 < sr.ntiles; t0 += kRoundTiles<D>) {
    if (t0 > 0) __syncthreads();
    load_round<D>(sr, t0, cr, ss);
    int hit = -1;
    double before = 0.0;
#pragma unroll
    for (int i = 0; i < kRoundTiles<D>; ++i) {
      const double m = round_mass(ss, i);
      if (m > 0.0) {
        last_tile = t0 + i;
        if (hit < 0 && acc + m > t) {
          hit = i;
          before = acc;
        }
      }
      if (hit < 0) acc += m;
    }
    if (hit >= 0) {
      pick_in_tile<D>(p, r, dec, sr, cr, hit, sr.base + (t0 + hit) * kTileTokens, t - before, ss);
      return;
    }
  }
  if (last_tile < 0) {  // cannot happen (see sample_chunked); a valid token regardless
    if (threadIdx.x == 0) write_sampled(p, r, dec, dec.first_max);
    return;
  }
  __syncthreads();
  load_round<D>(sr, last_tile, cr, ss);
  pick_in_tile<D>(p, r, dec, sr, cr, 0, sr.base + last_tile * kTileTokens, INFINITY, ss);
}

// Chunk sampling (one CTA per request). Level 1: the draw's chunk from row_stats' chunk masses
// z_c * e^(m_c - m) (the same FFMA + EX2 as the token weights); the chunk of an excluded draft x
// loses x's weight: subtracted when that keeps at least half the chunk's mass (no
// cancellation), else the chunk's mass without x is summed here (chunk_mass). Level 2
// (chunk_pick): the tile and then the token inside the chunk from one read of it, held in
// registers. Reads one chunk of the row (two when x dominates its chunk) instead of all of it.
// Level 1's masses and level 2's sums differ by float rounding only, which can move a draw at a
// chunk boundary to a neighbouring token with weight (the fallback takes the chunk's last token
// with weight). A chunk with mass has a token with weight: its maximum's weight is the factor
// e^(m_c - m) itself. Whole CTA.
template <LogitsDtype D>
__device__ void sample_chunked(const VerifyChainParams& p, const Workspace& ws, int32_t r,
                               const ReqSmem& rs, const Decision& dec, SampleRow sr,
                               SampleSmem& ss) {
  const RowBody b = row_body<D>(sr.rp, sr.vocab);
  const int32_t nchunks = ws.nsplit * kWarps;
  const float2* mz = ws.chunk_mz + dec.row * nchunks;
  const float ml = sr.ml;
  const auto est_mass = [&](int64_t c) -> float {
    const float2 v = __ldcg(mz + c);
    return v.y > 0.0f ? v.y * fast_weight(v.x, ml) : 0.0f;
  };
  const SampleRow row = sr;
  int32_t cx = -1;
  double wx = 0.0;
  if (dec.exclude >= 0 && dec.exclude < sr.vocab) {
    if (threadIdx.x == 0) ss.chunk = -1;
    __syncthreads();
    for (int32_t c = threadIdx.x; c < nchunks; c += kThreads) {
      const ChunkRange cr = chunk_range<D>(b, sr.vocab, c / kWarps, ws.nsplit, c % kWarps);
      if (cr.lo <= dec.exclude && dec.exclude < cr.hi) ss.chunk = c;  // exactly one
    }
    __syncthreads();
    cx = ss.chunk;
    const float est = est_mass(cx);
    const float ex = fast_weight(dec.exclude_score, ml);
    if (ex <= 0.5f * est) {
      wx = static_cast<double>(est - ex);
    } else {
      narrow_to_chunk<D>(sr, b, ws.nsplit, cx);
      wx = chunk_mass<D>(sr, ss);
    }
  }
  const bool any = pick_mass(
      nchunks, [&](int64_t c) { return c == cx ? wx : static_cast<double>(est_mass(c)); }, 0.0,
      false, rs, dec, ss);
  const int32_t c = static_cast<int32_t>(ss.tile);
  const double t_rem = ss.t_rem;
  __syncthreads();
  // Fused path: every sampling item of r (this one) has read r's decision: reset its counters
  // before any return.
  if (ws.decided != nullptr) arrive_last(ws, r, ss);
  if (!any) {
    if (threadIdx.x == 0) write_sampled(p, r, dec, dec.first_max);
    return;
  }
  sr = row;
  narrow_to_chunk<D>(sr, b, ws.nsplit, c);
  chunk_pick<D>(p, r, dec, sr, t_rem, ss);
}

// Kept sampling (group path, argmax drafts): the token at u * W over the sampled row's kept set,
// which row_filter wrote sorted by token (kn <= kKeptCap entries), less the rejected draft; the
// same weights as the tiled path (fast_weight of the same scores), summed per token in fp64, so
// a draw may differ from the tiled path's only where rounding moves it across a token boundary.
// One CTA. Whole CTA.
__device__ void sample_kept(const VerifyChainParams& p, const Workspace& ws, int32_t r,
                            const ReqSmem& rs, const Decision& dec, uint32_t kn, SampleSmem& ss) {
  const uint2* kl = ws.kept + dec.row * kKeptCap;
  const float ml = dec.m * kLog2e;
  const auto mass = [&](int64_t i) -> double {
    const uint2 e = __ldcg(kl + i);
    if (static_cast<int32_t>(e.x) == dec.exclude) return 0.0;
    return static_cast<double>(fast_weight(key_to_float(e.y), ml));
  };
  if (!pick_mass(static_cast<int64_t>(kn), mass, 0.0, false, rs, dec, ss)) {
    if (threadIdx.x == 0) write_sampled(p, r, dec, dec.first_max);
    return;
  }
  if (threadIdx.x == 0) write_sampled(p, r, dec, static_cast<int32_t>(__ldcg(&kl[ss.tile].x)));
}

// Which sampling paths a kernel compiles (kernels that run one path keep the other's registers).
// kKeptPath: the tiled path, but a filtered request whose sampled row has a kept list draws from
// it (sample_kept); compiled only into the kernel launched when kept lists exist.
enum : int { kTiledPath = 1, kChunkPath = 2, kBothPaths = 3, kKeptPath = 4 };

// This CTA's share of the sampled row; the last CTA of the request writes the token. Whole CTA.
// kInFlight (<= kTilesInFlight): tiles loaded together (register footprint only; the masses do not
// depend on it).
template <LogitsDtype D, int kInFlight = kTilesInFlight, int kPaths = kBothPaths>
__device__ void sample_request(const VerifyChainParams& p, const Workspace& ws, int32_t r,
                               const ReqSmem& rs, const Decision& dec, int split, SampleSmem& ss) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int nsample = ws.nsample;
  const int32_t vocab = p.vocab_size;
  const char* rp = row_ptr(p, dec.row, Elem<D>::kSize);
  const float* q = dec.q_row >= 0 ? p.draft_probs + dec.q_row * p.draft_probs_row_stride : nullptr;
  if (dec.mode == kModeRecovered && p.exponentials != nullptr) {
    // vLLM 0.28's exponential race: argmax of residual * (1/E) over residual > 0, no noise.
    const int64_t vb = static_cast<int64_t>(vocab) * split / nsample;
    const int64_t ve = static_cast<int64_t>(vocab) * (split + 1) / nsample;
    const float* e_row = p.exponentials + static_cast<int64_t>(r) * p.exponentials_row_stride;
    ArgMax best = argmax_none();
    for (int64_t v = vb + threadIdx.x; v < ve; v += kThreads) {
      const float s = score_of(load_scalar<D>(rp, v), rs.inv_t);
      const float pv = score_key(s) >= dec.key ? weight_of(s, dec.m) / dec.zf : 0.0f;
      const float res = q != nullptr ? pv - __ldg(q + v) : (v == dec.exclude ? 0.0f : pv);
      if (res > 0.0f) argmax_push(best, res * (1.0f / __ldg(e_row + v)), static_cast<int32_t>(v));
    }
    best = warp_argmax(best);
    if (lane == 0) ss.warp_best[warp] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
      ArgMax t = ss.warp_best[0];
      for (int w = 1; w < kWarps; ++w) t = argmax_merge(t, ss.warp_best[w]);
      ws.samples[static_cast<int64_t>(r) * nsample + split] = t;
    }
    if (arrive_last(ws, r, ss) && warp == 0) {
      ArgMax a = argmax_none();
      for (int s = lane; s < nsample; s += kWarp) {
        a = argmax_merge(a, ldcg_argmax(ws.samples + static_cast<int64_t>(r) * nsample + s));
      }
      a = warp_argmax(a);
      if (lane == 0) write_sampled(p, r, dec, a.idx < 0 ? dec.first_max : a.idx);
    }
    return;
  }
  SampleRow sr;
  sr.rp = rp;
  sr.q = q;
  sr.inv_t = rs.inv_t;
  sr.ml = dec.m * kLog2e;
  sr.zf = dec.zf;
  sr.key = dec.key;
  sr.exclude = dec.exclude;
  sr.vocab = vocab;
  sr.lo = 0;
  sr.hi = vocab;
  sr.base = 0;
  sr.ntiles = (static_cast<int64_t>(vocab) + kTileTokens - 1) / kTileTokens;
  sr.aligned = reinterpret_cast<uintptr_t>(rp) % static_cast<uintptr_t>(4 * Elem<D>::kSize) == 0;
  if constexpr ((kPaths & kChunkPath) != 0) {
    if (ws.chunk_mz != nullptr) {  // nsample == 1
      sample_chunked<D>(p, ws, r, rs, dec, sr, ss);
      return;
    }
  }
  if constexpr ((kPaths & kTiledPath) == 0) return;
  if constexpr ((kPaths & kKeptPath) != 0) {
    if (q == nullptr && rs.filtered) {
      const uint32_t kn = __ldcg(ws.kept_n + dec.row);  // the same for every CTA of the request
      if (kn != kKeptNone) {
        if (split == 0) sample_kept(p, ws, r, rs, dec, kn, ss);
        return;
      }
    }
  }
  tile_masses<D, kInFlight>(sr, split, nsample, ws.tile_mass + r * ws.tiles_per_req, ss);
  if (arrive_last(ws, r, ss)) cdf_pick<D>(p, ws, r, rs, dec, sr, ss);
}

// kChunks: chunk sampling (one CTA per request, a latency chain: registers rather than
// residency), else the tiled path.
template <LogitsDtype D, bool kChunks, bool kKept = false, int kCtas = kSampleCtasPerSm>
__global__ void __launch_bounds__(kThreads, kChunks ? kChunkCtasPerSm : kCtas)
    decide_sample_kernel(const VerifyChainParams p, const Workspace ws) {
  __shared__ ReqSmem rs;
  __shared__ DecideSmem ds;
  __shared__ SampleSmem ss;
  const int split = blockIdx.x;
  bool waited = false;
  for (int64_t r64 = blockIdx.y; r64 < p.num_reqs; r64 += gridDim.y) {
    const int32_t r = static_cast<int32_t>(r64);
    load_request(p, r, rs);  // inputs only
    if (!waited) {
      pdl_wait();  // row_stats / row_filter results and zeroed counters
      waited = true;
    }
    if (!rs.real) {
      if (split == 0) {
        Decision inert;
        inert.mode = kModeDone;
        inert.accepted = 0;
        inert.last = kPlaceholderTokenId;
        write_outputs(p, r, false, inert);
      }
    } else if (!rs.greedy || split == 0) {
      decide(p, ws, r, rs, ds);
      const Decision dec = ds.dec;
      if (split == 0) write_outputs(p, r, true, dec);
      if (dec.mode != kModeDone) {
        constexpr int kPaths = kChunks ? kChunkPath : (kKept ? kTiledPath | kKeptPath : kTiledPath);
        sample_request<D, kTilesInFlight, kPaths>(p, ws, r, rs, dec, split, ss);
      }
    }
    __syncthreads();
  }
  if (!waited) pdl_wait();
}

// ---- fused path: one kernel, a work queue ------------------------------------------------------
//
// Without top-k/top-p, the op can run as ONE kernel of resident CTAs that take work items from a
// global counter in order:
//   * stats item (row, split): row_stats' work for one split of one row (stats_item, the same
//     code, so the same bits); the CTA that completes a request's last stats item (arrival
//     counter) evaluates its acceptance chain (decide, the same code) and writes the outputs;
//     a random request's decision is published for its sampling items (decided[r], release);
//   * sampling item (r, g), g < nsample: decide_sample's CTA `g` of request r (sample_request,
//     the same code): it waits for decided[r] (acquire), computes its tile masses, and the last
//     of the request's items draws the token (cdf_pick).
// The items of request r sit in the queue after the stats items of request r + lag, so its
// decision is usually ready when they are fetched and most of its sampled row is still in L2;
// the last `lag` requests' sampling items come after all stats items. Results equal the
// unfused path bit for bit: every value is computed by the same code on the same inputs (tile
// masses and the final draw do not depend on which CTA computes them).
//
// Deadlock freedom: an item is fetched only by a running CTA, and a CTA fetches its next item
// only after finishing the current one. Stats items never wait; a sampling item waits only for
// stats items of its request, which all have lower queue indices, hence were fetched earlier by
// running CTAs. By induction on the lowest unfinished index, every item finishes.
//
// Graph safety: the counters (next_item, exited, stats_arrivals[B], sample_arrivals[B],
// decided[B]) are persistent and zero on entry; the last user of each resets it (the deciding
// CTA: stats_arrivals[r]; the last sampling item: sample_arrivals[r] and decided[r]; the last
// CTA to exit: next_item and exited), so they are zero again when the kernel completes. No host
// synchronisation, any number of launches and replays. Two launches must not overlap in time on
// one device (they share the counters): calls on one stream (or one graph) are serialised.

struct FusedItem {
  int32_t kind;  // 0 stats, 1 sampling
  int32_t r;     // request
  int64_t row;   // stats: logits row
  int32_t part;  // stats: split; sampling: g
};

// First queue index of block r (r in [0, B]): the stats items of requests < r and the sampling
// items of requests < r - lag.
__device__ __forceinline__ int64_t fused_block_start(const VerifyChainParams& p,
                                                     const Workspace& ws, int32_t r) {
  const int64_t first_row =
      r < p.num_reqs ? request_span(p.cu_num_draft_tokens, r, p.num_draft_tokens).first_row
                     : p.num_rows;
  const int64_t sampled = r - ws.lag > 0 ? static_cast<int64_t>(r - ws.lag) : 0;
  return first_row * ws.nsplit + sampled * ws.nsample;
}

// The work item at queue index `item` (< total_items). Whole warp, uniform result. Block r holds
// the (n_r + 1) * nsplit stats items of request r (row-major: split fastest, as row_stats' grid),
// then the nsample sampling items of request r - lag (r >= lag); after block B - 1 come the
// sampling items of requests max(0, B - lag) .. B - 1.
__device__ FusedItem fused_item(const VerifyChainParams& p, const Workspace& ws, int64_t item) {
  const int lane = threadIdx.x % kWarp;
  FusedItem it;
  const int64_t tail = fused_block_start(p, ws, p.num_reqs);
  if (item >= tail) {
    const int64_t k = item - tail;
    const int32_t r0 = p.num_reqs - ws.lag > 0 ? p.num_reqs - ws.lag : 0;
    it.kind = 1;
    it.r = r0 + static_cast<int32_t>(k / ws.nsample);
    it.part = static_cast<int32_t>(k % ws.nsample);
    it.row = -1;
    return it;
  }
  // The largest r with start(r) <= item (32-ary search, as request_of_row_warp).
  int32_t lo = 0, hi = p.num_reqs - 1;
  while (lo < hi) {
    const int64_t span = static_cast<int64_t>(hi) - lo;
    const int32_t probe = lo + static_cast<int32_t>(((lane + 1) * span + kWarp - 1) / kWarp);
    const bool ok = fused_block_start(p, ws, probe) <= item;
    const uint32_t m = __ballot_sync(0xffffffffu, ok);
    if (m == 0) {
      hi = __shfl_sync(0xffffffffu, probe, 0) - 1;
    } else {
      const int last = 31 - __clz(static_cast<int>(m));
      const int32_t p_last = __shfl_sync(0xffffffffu, probe, last);
      const int32_t p_next = __shfl_sync(0xffffffffu, probe, last < 31 ? last + 1 : 31);
      lo = p_last;
      if (last < 31) hi = p_next - 1;
    }
  }
  const RequestSpan span = request_span(p.cu_num_draft_tokens, lo, p.num_draft_tokens);
  const int64_t local = item - fused_block_start(p, ws, lo);
  const int64_t nstats = (static_cast<int64_t>(span.num_drafts) + 1) * ws.nsplit;
  if (local < nstats) {
    it.kind = 0;
    it.r = lo;
    it.row = span.first_row + local / ws.nsplit;
    it.part = static_cast<int32_t>(local % ws.nsplit);
  } else {
    it.kind = 1;
    it.r = lo - ws.lag;
    it.part = static_cast<int32_t>(local - nstats);
    it.row = -1;
  }
  return it;
}

struct DecideAll {
  ReqSmem rs;
  DecideSmem ds;
  SampleSmem ss;
};

// The deciding CTA of request r (it completed r's last stats item). Whole CTA.
__device__ __noinline__ void fused_decide(const VerifyChainParams& p, const Workspace& ws,
                                          int32_t r, DecideAll& sm) {
  load_request(p, r, sm.rs);
  if (!sm.rs.real) {
    Decision inert;
    inert.mode = kModeDone;
    inert.accepted = 0;
    inert.last = kPlaceholderTokenId;
    write_outputs(p, r, false, inert);
    return;
  }
  decide(p, ws, r, sm.rs, sm.ds);
  const Decision dec = sm.ds.dec;
  write_outputs(p, r, true, dec);
  if (!sm.rs.greedy && threadIdx.x == 0) {
    ws.decisions[r] = dec;
    __threadfence();
    atomicExch(ws.decided + r, dec.mode == kModeDone ? 2u : 1u);
  }
}

__device__ __forceinline__ uint32_t ld_acquire_u32(const uint32_t* ptr) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

// Sampling item g of request r. Whole CTA.
template <LogitsDtype D>
__device__ __noinline__ void fused_sample(const VerifyChainParams& p, const Workspace& ws,
                                          int32_t r, int g, DecideAll& sm) {
  load_request_head(p, r, sm.rs);
  if (!sm.rs.real || sm.rs.greedy) return;  // nothing is sampled for this request
  __shared__ Decision s_dec;
  __shared__ uint32_t s_state;
  if (threadIdx.x == 0) {
    uint32_t st;
    while ((st = ld_acquire_u32(ws.decided + r)) == 0) __nanosleep(128);
    s_state = st;
    const Decision* d = ws.decisions + r;
    Decision dec;
    dec.mode = __ldcg(&d->mode);
    dec.accepted = __ldcg(&d->accepted);
    dec.exclude = __ldcg(&d->exclude);
    dec.exclude_score = __ldcg(&d->exclude_score);
    dec.first_max = __ldcg(&d->first_max);
    dec.last = __ldcg(&d->last);
    dec.key = __ldcg(&d->key);
    dec.row = __ldcg(reinterpret_cast<const long long*>(&d->row));
    dec.q_row = __ldcg(reinterpret_cast<const long long*>(&d->q_row));
    dec.m = __ldcg(&d->m);
    dec.zf = __ldcg(&d->zf);
    s_dec = dec;
  }
  __syncthreads();
  const Decision dec = s_dec;
  if (s_state == 2u) {  // a random request with nothing to sample (given bonus id): just arrive
    if (threadIdx.x == 0 &&
        atomicAdd(ws.sample_arrivals + r, 1u) == static_cast<uint32_t>(ws.nsample - 1)) {
      ws.sample_arrivals[r] = 0;
      ws.decided[r] = 0;
    }
    __syncthreads();
    return;
  }
  sample_request<D, kFusedTilesInFlight>(p, ws, r, sm.rs, dec, g, sm.ss);
}

template <LogitsDtype D>
__global__ void __launch_bounds__(kThreads, 4)
    fused_kernel(const VerifyChainParams p, const Workspace ws) {
  __shared__ union {
    StatsSmem st;
    DecideAll dc;
  } sm;
  __shared__ FusedItem s_item;
  __shared__ int32_t s_last;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  for (;;) {
    __shared__ unsigned long long s_index;
    if (threadIdx.x == 0) s_index = atomicAdd(ws.next_item, 1ull);
    __syncthreads();
    const int64_t index = static_cast<int64_t>(s_index);
    if (index >= ws.total_items) break;  // uniform
    if (warp == 0) {
      const FusedItem it = fused_item(p, ws, index);
      if (lane == 0) s_item = it;
    }
    __syncthreads();
    const FusedItem it = s_item;
    if (it.kind == 0) {
      stats_item<D>(p, ws, it.row, it.part, sm.st);
      if (threadIdx.x == 0) {
        const RequestSpan span = request_span(p.cu_num_draft_tokens, it.r, p.num_draft_tokens);
        const uint32_t need = static_cast<uint32_t>((span.num_drafts + 1) * ws.nsplit);
        __threadfence();  // this item's partial before the arrival
        const bool last = atomicAdd(ws.stats_arrivals + it.r, 1u) == need - 1;
        if (last) {
          ws.stats_arrivals[it.r] = 0;  // every stats item of r has arrived
          __threadfence();
        }
        s_last = last;
      }
      __syncthreads();
      if (s_last) fused_decide(p, ws, it.r, sm.dc);
    } else {
      fused_sample<D>(p, ws, it.r, it.part, sm.dc);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    __threadfence();                                  // this CTA's last fetch before its exit count
    if (atomicAdd(ws.exited, 1u) == gridDim.x - 1) {  // every CTA is past its last fetch
      atomicExch(ws.next_item, 0ull);
      atomicExch(ws.exited, 0u);
    }
  }
}

// ---- launch
// --------------------------------------------------------------------------------------

struct Layout {
  int32_t nsplit = 1;
  int32_t nsample = 1;
  int32_t sample_ctas = kSampleCtasPerSm;  // tiled decide_sample CTAs per SM (2 or 3)
  int64_t tiles = 1;                       // inverse-CDF tiles per row
  int32_t cand_cap = kCandCap;
  bool filter = false;
  bool chunks = false;         // chunk sampling (decide_sample: one CTA per request)
  bool topk_in_stats = false;  // PEAGLE_VERIFY_TOPK_IN_STATS=1 with filtering
  size_t off_topk_cand = 0, off_topk_meta = 0;
  size_t off_parts = 0, off_chunk_mz = 0, off_tile_mass = 0, off_stats = 0, off_cand_count = 0;
  size_t off_filter_arrivals = 0;
  size_t off_group_max = 0;
  size_t off_kept = 0, off_kept_n = 0;
  bool kept = false;        // kept sampling (group path)
  int32_t group_slots = 0;  // 0: no group maxima (row_filter streams every row)
  size_t off_cand_keys = 0, off_sample_arrivals = 0, off_samples = 0, total = 0;
  // Fused path (fused_kernel): one kernel over a work queue, persistent counters.
  bool fused = false;
  int32_t lag = 0;
  int64_t total_items = 0;
  int32_t grid = 0;  // resident CTAs
  size_t off_decisions = 0;
};

// Counter words of the fused path: next_item (2 words), exited, pad, then stats_arrivals[B],
// sample_arrivals[B], decided[B].
constexpr int64_t kCounterHeaderWords = 4;
inline int64_t counter_words(int64_t reqs) {
  return kCounterHeaderWords + 3 * reqs;
}

// PEAGLE_VERIFY_FUSED=1 selects the one-kernel path where it applies (read at every call, so at
// graph capture); anything else (the default): the 2-3 kernel path. Both give the same bits.
inline bool fused_requested() {
  const char* v = std::getenv("PEAGLE_VERIFY_FUSED");
  return v != nullptr && v[0] == '1';
}

// Chunk sampling applies without top-k / top-p, draft_probs and exponentials (the sampled
// weights are then row_stats' normaliser terms, less at most one excluded draft); it is chosen
// by verify_chain_heuristics::use_chunks. PEAGLE_VERIFY_CHUNKS (read at every call) = 1 / 0
// forces it on / off where it applies (A/B and tests); the two paths agree except where
// rounding moves a draw across a chunk boundary.
inline bool chunks_chosen(int64_t reqs) {
  const char* v = std::getenv("PEAGLE_VERIFY_CHUNKS");
  if (v != nullptr && (v[0] == '0' || v[0] == '1')) return v[0] == '1';
  return verify_chain_heuristics::use_chunks(reqs);
}

// PEAGLE_VERIFY_TOPK_IN_STATS=1 (read at every call): with top_k / top_p, row_stats also
// collects the top-k candidates of rows with top_k <= kStatsTopK and row_filter selects on them
// without reading those rows again where they prove the threshold. Same bits either way.
inline bool topk_in_stats_requested() {
  const char* v = std::getenv("PEAGLE_VERIFY_TOPK_IN_STATS");
  return v != nullptr && v[0] == '1';
}

// PEAGLE_VERIFY_FILTER_STREAM=1 (read at every call): row_filter reads every filtered row whole
// instead of only the groups whose maximum (row_stats' group_max) reaches its candidate bound.
// Same candidates, same bits (tests).
inline bool filter_stream_requested() {
  const char* v = std::getenv("PEAGLE_VERIFY_FILTER_STREAM");
  return v != nullptr && v[0] == '1';
}

// PEAGLE_VERIFY_KEPT_SAMPLING=0 (read at every call): on the group path, decide_sample reads the
// sampled rows (tiled path) instead of drawing from row_filter's kept lists. The two agree except
// where rounding moves a draw across a token boundary (tests).
inline bool kept_sampling_requested() {
  const char* v = std::getenv("PEAGLE_VERIFY_KEPT_SAMPLING");
  return !(v != nullptr && v[0] == '0');
}

// PEAGLE_VERIFY_RADIX_SELECT=1 (read at every call): row_filter selects every threshold by radix
// digits, also where it would rank the candidates (rank_select). Same bits either way (tests).
inline bool radix_select_requested() {
  const char* v = std::getenv("PEAGLE_VERIFY_RADIX_SELECT");
  return v != nullptr && v[0] == '1';
}

// Residency of the tiled decide_sample (its __launch_bounds__; verify_chain_heuristics::
// sample_ctas_per_sm); PEAGLE_VERIFY_SAMPLE_CTAS=2 / 3 (read at every call) forces it.
inline int32_t sample_ctas_per_sm(int64_t reqs) {
  const char* v = std::getenv("PEAGLE_VERIFY_SAMPLE_CTAS");
  if (v != nullptr && (v[0] == '2' || v[0] == '3')) return v[0] - '0';
  return verify_chain_heuristics::sample_ctas_per_sm(reqs);
}

// row_stats / row_filter CTAs per logits row (verify_chain_heuristics::stats_splits);
// PEAGLE_VERIFY_STATS_SPLITS=N (read at every call) forces N, within the same cap of one split
// per kMinStatsElems logits (sweeps: chunk sampling's chunks are the splits' warps, so N also
// sizes them). Greedy results never depend on it; random ones only through float rounding.
inline int32_t stats_splits_chosen(int64_t sms, int64_t rows, int64_t vocab) {
  namespace h = verify_chain_heuristics;
  const char* v = std::getenv("PEAGLE_VERIFY_STATS_SPLITS");
  if (v != nullptr) {
    const long n = std::strtol(v, nullptr, 10);
    if (n >= 1 && n <= 1024) {
      return static_cast<int32_t>(
          h::clamp_splits(n, (vocab + kMinStatsElems - 1) / kMinStatsElems));
    }
  }
  return h::stats_splits(sms, rows, vocab, kMinStatsElems);
}

template <LogitsDtype D>
int32_t fused_ctas_per_sm() {
  static const int32_t n = [] {
    int blocks = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fused_kernel<D>, kThreads, 0) !=
            cudaSuccess ||
        blocks <= 0) {
      (void)cudaGetLastError();
      blocks = 1;
    }
    return blocks;
  }();
  return n;
}

__host__ __device__ inline size_t align_up(size_t x) {
  return (x + 255) & ~size_t(255);
}

Layout plan(const VerifyChainParams& p) {
  Layout l;
  namespace h = verify_chain_heuristics;
  const int64_t sms = sm_count();
  const int64_t rows = p.num_rows > 0 ? p.num_rows : 1;
  const int64_t reqs = p.num_reqs > 0 ? p.num_reqs : 1;
  l.nsplit = stats_splits_chosen(sms, rows, p.vocab_size);
  l.tiles = (static_cast<int64_t>(p.vocab_size) + kTileTokens - 1) / kTileTokens;
  l.filter = p.top_k != nullptr || p.top_p != nullptr;
  l.chunks = !l.filter && p.draft_probs == nullptr && p.exponentials == nullptr &&
             chunks_chosen(p.num_reqs);
  l.sample_ctas = sample_ctas_per_sm(p.num_reqs);
  l.nsample = l.chunks ? 1 : h::sample_ctas(sms, l.sample_ctas, reqs, l.tiles);
  l.fused = !l.filter && p.num_reqs > 0 && fused_requested();
  if (l.fused) {
    int32_t per_sm = 4;
    switch (p.logits_dtype) {
      case LogitsDtype::kBFloat16:
        per_sm = fused_ctas_per_sm<LogitsDtype::kBFloat16>();
        break;
      case LogitsDtype::kFloat16:
        per_sm = fused_ctas_per_sm<LogitsDtype::kFloat16>();
        break;
      default:
        per_sm = fused_ctas_per_sm<LogitsDtype::kFloat32>();
    }
    const int64_t resident = sms * per_sm;
    l.total_items = rows * l.nsplit + reqs * l.nsample;
    l.grid = static_cast<int32_t>(resident < l.total_items ? resident : l.total_items);
    l.lag = h::fused_lag(l.grid, rows * l.nsplit / reqs + l.nsample, reqs);
  }
  l.cand_cap = h::candidate_cap(static_cast<int64_t>(kCandPoolBytes / sizeof(uint32_t)), rows,
                                kCandCap, kMinCandCap);
  size_t off = 0;
  l.off_parts = off;
  off = align_up(off + sizeof(RowPartial) * static_cast<size_t>(rows) * l.nsplit);
  l.off_chunk_mz = off;
  if (l.chunks)
    off = align_up(off + sizeof(float2) * static_cast<size_t>(rows) * l.nsplit * kWarps);
  l.off_tile_mass = off;
  off = align_up(off + sizeof(double) * static_cast<size_t>(reqs) * l.tiles);
  l.off_sample_arrivals = off;
  off = align_up(off + sizeof(uint32_t) * static_cast<size_t>(reqs));
  l.off_samples = off;
  off = align_up(off + sizeof(ArgMax) * static_cast<size_t>(reqs) * l.nsample);
  l.off_decisions = off;
  if (l.fused) off = align_up(off + sizeof(Decision) * static_cast<size_t>(reqs));
  if (l.filter) {
    l.off_stats = off;
    off = align_up(off + sizeof(RowStats) * static_cast<size_t>(rows));
    l.off_cand_count = off;
    off = align_up(off + sizeof(uint32_t) * static_cast<size_t>(rows));
    l.off_filter_arrivals = off;
    off = align_up(off + sizeof(uint32_t) * static_cast<size_t>(rows));
    l.off_cand_keys = off;
    off = align_up(off + sizeof(uint32_t) * static_cast<size_t>(rows) * l.cand_cap);
    l.topk_in_stats = topk_in_stats_requested();
    const int64_t epv = p.logits_dtype == LogitsDtype::kFloat32 ? 4 : 8;
    const int64_t split_vecs = (p.vocab_size / epv + l.nsplit - 1) / l.nsplit;
    const int64_t chunk_vecs = (split_vecs + kWarps - 1) / kWarps;
    if (!l.topk_in_stats && !filter_stream_requested() && h::use_filter_groups(chunk_vecs)) {
      constexpr int64_t kSpan = static_cast<int64_t>(kWarp) * kGroupVecs;
      l.group_slots = static_cast<int32_t>(kWarp * ((chunk_vecs + kSpan - 1) / kSpan));
      l.off_group_max = off;
      off = align_up(off + sizeof(uint2) * static_cast<size_t>(rows) * l.nsplit * kWarps *
                               static_cast<size_t>(l.group_slots));
      l.kept = kept_sampling_requested();
      if (l.kept) {
        l.off_kept = off;
        off = align_up(off + sizeof(uint2) * static_cast<size_t>(rows) * kKeptCap);
        l.off_kept_n = off;
        off = align_up(off + sizeof(uint32_t) * static_cast<size_t>(rows));
      }
    }
    if (l.topk_in_stats) {
      const size_t parts = static_cast<size_t>(rows) * l.nsplit;
      l.off_topk_meta = off;
      off = align_up(off + sizeof(TopkMeta) * parts);
      l.off_topk_cand = off;
      off = align_up(off + sizeof(uint32_t) * parts * kStatsCandCap);
    }
  }
  l.total = off;
  return l;
}

template <LogitsDtype D>
cudaError_t launch_typed(const VerifyChainParams& p, const Layout& l, char* base,
                         uint32_t* counters, cudaStream_t stream) {
  Workspace ws;
  ws.parts = reinterpret_cast<RowPartial*>(base + l.off_parts);
  ws.tile_mass = reinterpret_cast<double*>(base + l.off_tile_mass);
  ws.chunk_mz = l.chunks ? reinterpret_cast<float2*>(base + l.off_chunk_mz) : nullptr;
  ws.tiles_per_req = l.tiles;
  ws.sample_arrivals = reinterpret_cast<uint32_t*>(base + l.off_sample_arrivals);
  ws.samples = reinterpret_cast<ArgMax*>(base + l.off_samples);
  ws.stats = l.filter ? reinterpret_cast<RowStats*>(base + l.off_stats) : nullptr;
  ws.cand_count = l.filter ? reinterpret_cast<uint32_t*>(base + l.off_cand_count) : nullptr;
  ws.filter_arrivals =
      l.filter ? reinterpret_cast<uint32_t*>(base + l.off_filter_arrivals) : nullptr;
  ws.cand_keys = l.filter ? reinterpret_cast<uint32_t*>(base + l.off_cand_keys) : nullptr;
  ws.nsplit = l.nsplit;
  ws.nsample = l.nsample;
  ws.cand_cap = l.cand_cap;
  ws.rank_max = radix_select_requested() ? 0 : kRankMax;
  ws.group_max = l.group_slots > 0 ? reinterpret_cast<uint2*>(base + l.off_group_max) : nullptr;
  ws.group_slots = l.group_slots;
  ws.exact_bound = verify_chain_heuristics::use_exact_bound(
      l.group_slots == 0, (static_cast<int64_t>(p.vocab_size) + l.nsplit - 1) / l.nsplit);
  ws.kept = l.kept ? reinterpret_cast<uint2*>(base + l.off_kept) : nullptr;
  ws.kept_n = l.kept ? reinterpret_cast<uint32_t*>(base + l.off_kept_n) : nullptr;
  ws.topk_cand = l.topk_in_stats ? reinterpret_cast<uint32_t*>(base + l.off_topk_cand) : nullptr;
  ws.topk_meta = l.topk_in_stats ? reinterpret_cast<TopkMeta*>(base + l.off_topk_meta) : nullptr;
  ws.next_item = nullptr;
  ws.exited = nullptr;
  ws.stats_arrivals = nullptr;
  ws.decided = nullptr;
  ws.decisions = nullptr;
  ws.total_items = 0;
  ws.lag = 0;
  if (l.fused && counters != nullptr) {
    const int64_t b = p.num_reqs;
    ws.next_item = reinterpret_cast<unsigned long long*>(counters);
    ws.exited = counters + 2;
    ws.stats_arrivals = counters + kCounterHeaderWords;
    ws.sample_arrivals = counters + kCounterHeaderWords + b;  // persistent, not the per-call one
    ws.decided = counters + kCounterHeaderWords + 2 * b;
    ws.decisions = reinterpret_cast<Decision*>(base + l.off_decisions);
    ws.total_items = l.total_items;
    ws.lag = l.lag;
    fused_kernel<D><<<dim3(static_cast<unsigned>(l.grid)), kThreads, 0, stream>>>(p, ws);
    return cudaGetLastError();
  }
  const unsigned grid_rows = static_cast<unsigned>(p.num_rows < kMaxGridY ? p.num_rows : kMaxGridY);
  const unsigned grid_reqs = static_cast<unsigned>(p.num_reqs < kMaxGridY ? p.num_reqs : kMaxGridY);
  if (l.topk_in_stats) {
    row_stats_kernel<D, true><<<dim3(l.nsplit, grid_rows), kThreads, 0, stream>>>(p, ws);
  } else {
    row_stats_kernel<D><<<dim3(l.nsplit, grid_rows), kThreads, 0, stream>>>(p, ws);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (l.filter) {
    // The group path reads a few groups per row: one CTA per row, no cross-CTA candidate merge.
    const unsigned filter_ctas = l.group_slots > 0 ? 1u : static_cast<unsigned>(l.nsplit);
    err = l.topk_in_stats ? launch_pdl(row_filter_kernel<D, true>, dim3(l.nsplit, grid_rows),
                                       dim3(kThreads), 0, stream, p, ws)
                          : launch_pdl(row_filter_kernel<D>, dim3(filter_ctas, grid_rows),
                                       dim3(kThreads), 0, stream, p, ws);
    if (err != cudaSuccess) return err;
  }
  if (l.chunks) {
    return launch_pdl(decide_sample_kernel<D, true>, dim3(1, grid_reqs), dim3(kThreads), 0, stream,
                      p, ws);
  }
  const bool two = l.sample_ctas == 2;
  if (l.kept) {
    return two ? launch_pdl(decide_sample_kernel<D, false, true, 2>, dim3(l.nsample, grid_reqs),
                            dim3(kThreads), 0, stream, p, ws)
               : launch_pdl(decide_sample_kernel<D, false, true>, dim3(l.nsample, grid_reqs),
                            dim3(kThreads), 0, stream, p, ws);
  }
  if (two) {
    return launch_pdl(decide_sample_kernel<D, false, false, 2>, dim3(l.nsample, grid_reqs),
                      dim3(kThreads), 0, stream, p, ws);
  }
  return launch_pdl(decide_sample_kernel<D, false>, dim3(l.nsample, grid_reqs), dim3(kThreads), 0,
                    stream, p, ws);
}

}  // namespace

size_t verify_chain_workspace_bytes(const VerifyChainParams& p) {
  return plan(p).total;
}

size_t verify_chain_counter_words(const VerifyChainParams& p) {
  const Layout l = plan(p);
  return l.fused ? static_cast<size_t>(counter_words(p.num_reqs)) : 0;
}

cudaError_t launch_verify_chain(const VerifyChainParams& p, void* workspace, uint32_t* counters,
                                cudaStream_t stream) {
  if (p.num_reqs <= 0) return cudaSuccess;
  const Layout l = plan(p);
  char* ws = static_cast<char*>(workspace);
  switch (p.logits_dtype) {
    case LogitsDtype::kBFloat16:
      return launch_typed<LogitsDtype::kBFloat16>(p, l, ws, counters, stream);
    case LogitsDtype::kFloat16:
      return launch_typed<LogitsDtype::kFloat16>(p, l, ws, counters, stream);
    default:
      return launch_typed<LogitsDtype::kFloat32>(p, l, ws, counters, stream);
  }
}

cudaError_t launch_verify_chain(const VerifyChainParams& p, void* workspace, cudaStream_t stream) {
  return launch_verify_chain(p, workspace, nullptr, stream);
}

}  // namespace peagle
