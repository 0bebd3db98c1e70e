// verify_chain's host-side launch-size rules (used by plan() in verify_chain.cu), one function
// each with its rule and a worked example (H200: 132 SMs; V = 201088, K = 7). The measurements
// behind them are in docs/architecture.md ("verify_chain straight from the logits").
#pragma once
#include <cstdint>

namespace peagle {
namespace verify_chain_heuristics {

inline int64_t clamp_splits(int64_t want, int64_t cap) {
  if (cap < 1) cap = 1;
  return want < 1 ? 1 : (want > cap ? cap : want);
}

// row_stats / row_filter CTAs per logits row: about 8 CTAs per SM over all rows (two waves of
// 4 resident 256-thread CTAs), at least `min_elems` logits each.
//   B=64: R = 64 * 8 = 512 rows -> ceil(8 * 132 / 512) = 3 splits of 67K logits;
//   B=1:  R = 8 -> ceil(1056 / 8) = 132, capped at ceil(201088 / 4096) = 50 splits of 4K.
inline int32_t stats_splits(int64_t sms, int64_t rows, int64_t vocab, int64_t min_elems) {
  const int64_t elems_cap = (vocab + min_elems - 1) / min_elems;
  return static_cast<int32_t>(clamp_splits((8 * sms + rows - 1) / rows, elems_cap));
}

// decide_sample CTAs per request: one wave of resident CTAs (`ctas_per_sm`, its
// __launch_bounds__), at least one inverse-CDF tile each (its CTAs are latency chains, so a
// second wave costs whole chains).
//   B=64, 3 CTAs per SM, tiles of 2048 tokens (99 tiles) -> (3 * 132) / 64 = 6 CTAs per request.
inline int32_t sample_ctas(int64_t sms, int64_t ctas_per_sm, int64_t reqs, int64_t tiles) {
  return static_cast<int32_t>(clamp_splits((ctas_per_sm * sms) / reqs, tiles));
}

// Tiled decide_sample CTAs per SM (its __launch_bounds__, and the wave sample_ctas fills): 2 below
// 32 requests (128 registers: its acceptance-and-sampling chain keeps every value in registers),
// 3 from 32 (80 registers, ~50 bytes spilled; one wider wave). Measured on the H200 (V = 201088,
// same build, interleaved x2): with 2, B=1 T=0.7 20.45 -> 19.6 us, B=1 greedy 9.66 -> 9.44,
// B=8 T=0.7 36.74 -> 36.1, B=1 / B=8 top-k 50 + top-p 0.9 71.0 -> 69.9 / 108.2 -> 107.2; but
// B=64 top-p 0.9 alone (the tiled path behind the radix fallback) 1103 -> 1111 us.
inline int32_t sample_ctas_per_sm(int64_t reqs) {
  return reqs < 32 ? 2 : 3;
}

// Chunk sampling (one decide_sample CTA per request reads one or two chunks of the sampled row)
// or the tiled path (S2 CTAs per request read all of it): chunks from 32 requests. Measured on
// the H200 at V = 201088 / 151936, T = 0.7 (docs/architecture.md): chunks 0.91x / 0.94x the tiled
// time at B = 64 (its re-read of 64 rows is gone), 1.04x / 1.11x at B = 8 and 1.23x / 1.27x at
// B = 1, where the tiled path's 99 or 12 CTAs per request each read a tile or two in parallel and
// the one chunk CTA's longer chain of dependent steps costs more; at V = 201088 B = 16 1.01x,
// B = 32 0.97x (benchmarks/results/verify-chunks-crossover-h200.json).
inline bool use_chunks(int64_t reqs) {
  return reqs >= 32;
}

// Top-k candidate bound of a split in row_stats: the exact k-th largest of its 256 thread maxima
// (256 compares per thread) where row_filter streams the rows and a split holds >= 8192 logits,
// else the smallest over warps of each warp's ceil(k/8)-th largest (32 shuffles; a looser lower
// bound). Measured on the H200 (V = 201088, top-k 50 + top-p 0.9, same run): B=8 (17 splits of
// 11.8K logits, streamed) 119.8 -> 108.3 us with the exact bound; B=1 (50 splits of 4K) 71.7 ->
// 73.2 us, so small splits keep the per-warp bound; B=64 (group records) is not affected.
inline bool use_exact_bound(bool rows_stream, int64_t split_elems) {
  return rows_stream && split_elems >= 8192;
}

// Fused path: the sampling items of request r follow the stats items of request r + lag. The
// queue runs about `grid` items (one per resident CTA) ahead of completion, so r's decision is
// usually ready once about `grid` items have been handed out after r's stats items:
// lag = ceil(grid / items per request) + 1, at most B.
//   B=64, 528 resident CTAs, 8 rows * 3 splits + 6 sampling items = 30 per request -> 19;
//   B=1 -> 1 (the sampling items follow every stats item).
inline int32_t fused_lag(int64_t grid, int64_t items_per_req, int64_t reqs) {
  if (items_per_req < 1) items_per_req = 1;
  return static_cast<int32_t>(clamp_splits((grid + items_per_req - 1) / items_per_req + 1, reqs));
}

// Candidate keys kept per row by the top-k/top-p filter: `cap` while the rows fit in a pool of
// `pool_keys` keys, fewer beyond (at least `min_cap`), so the workspace stays bounded; a row with
// more candidates takes the radix fallback.
//   pool 64 MB = 16M keys: R = 512 -> 32768 per row, capped at 4096; R = 8192 -> 2048.
inline int32_t candidate_cap(int64_t pool_keys, int64_t rows, int64_t cap, int64_t min_cap) {
  const int64_t fit = pool_keys / rows;
  return static_cast<int32_t>(fit > cap ? cap : (fit < min_cap ? min_cap : fit));
}

// Filtered rows: row_stats writes a record per group of 16 vectors of a thread (its largest
// score, which vector holds it, the largest of the others) and row_filter then reads, in one CTA
// per row, only the vectors that may reach its candidate bound (mostly one per group that does),
// when a warp's chunk holds at least 16 vectors per lane (chunk_vecs >= 32 * 16); with fewer, a
// lane would wait for its record and then for its vectors where streaming them is one load.
//   B=64, V=201088 bf16: 3 splits, 1048 vectors per chunk -> groups (3 per lane; ~160 of the
//   row's 2304 groups reach a top-k 50 bound at T=0.7); B=1: 50 splits, 63 vectors -> stream.
inline bool use_filter_groups(int64_t chunk_vecs) {
  return chunk_vecs >= 32 * 16;
}

}  // namespace verify_chain_heuristics
}  // namespace peagle
