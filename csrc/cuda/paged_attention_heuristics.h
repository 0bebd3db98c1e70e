// paged_attention's host-side launch-size rules (used by plan_paged_attention in
// paged_attention.cu), one function each with its rule and a worked example (H200: 132 SMs;
// P-EAGLE decode with K = 7: 14 query rows per request). Torch-free. How these rules were chosen
// (split sweeps, tile shapes, the wgmma/mma.sync crossover) is in docs/architecture.md
// ("paged_attention") and PERF.md; the code keeps only the rules.
#pragma once
#include <cstdint>

namespace peagle {
namespace paged_attention_heuristics {

// Packed (query row, head-in-group) rows per query tile: 64 for GQA groups G <= 4, else 128. It
// depends on G only -- never on the max_query_len hint -- so a fixed num_splits is
// bit-reproducible for any hint.
//   32/8 heads: G = 4, a 14-row request packs 56 rows -> one 64-row tile;
//   64/8 heads: G = 8 -> 112 rows -> one 128-row tile.
inline int32_t tile_rows(int64_t group) {
  return group <= 4 ? 64 : 128;
}

// Tensor-core path: wgmma on sm_90 (where the wgmma kernels were compiled: sm_90a) for G >= 4,
// mma.sync otherwise (small groups leave a 64-row warpgroup tile mostly empty).
//   32/8 and 64/8 heads on an H200 -> wgmma; 8/8 heads (G = 1) -> mma.sync; sm_100 -> mma.sync.
inline bool use_wgmma(bool has_wgmma, int64_t group) {
  return has_wgmma && group >= 4;
}

// CTAs along the packed-row axis per (request, KV head): the query tiles the max_query_len hint
// implies, capped so that the 1-D grid B * Hkv * q_tile_ctas * splits stays under grid_limit
// (extra tiles are then looped over inside a CTA).
//   G = 8, hint 14: ceil(112 / 128) = 1; a 2000-row prefill hint with G = 8: ceil(16000 / 128) =
//   125 CTAs.
inline int32_t query_tile_ctas(int64_t group, int64_t rows_hint, int64_t block_m,
                               int64_t reqs_heads, int64_t fixed_splits, int64_t grid_limit) {
  const int64_t q_tiles = (group * (rows_hint > 0 ? rows_hint : 1) + block_m - 1) / block_m;
  int64_t cap = grid_limit / ((reqs_heads > 0 ? reqs_heads : 1) * fixed_splits);
  cap = cap < 1 ? 1 : cap;
  return static_cast<int32_t>(q_tiles < cap ? q_tiles : cap);
}

// Query tile rows for GQA groups > 4 on the wgmma path under automatic splits: 64 instead of
// tile_rows' 128 where the batch's KV is short -- at most ~1k keys per SM, counted from the
// block table's capacity (B * Hkv * max_blocks_per_seq * block_size <= 1024 * SMs: host-known,
// an upper bound on the keys read). There the op is a latency chain (one or two KV tiles per
// split), and two 64-row CTAs per KV head halve each CTA's row work (the second read of the
// tile mostly from L2); with more KV the second read costs bandwidth and 128 rows win.
// Fixed num_splits keep tile_rows (a request's bits never depend on the batch or the table).
//   64/8 x 64, page 16: B = 1 up to kv 16k (131072 key-heads <= 135168 on 132 SMs), B = 2 and 4
//   up to kv 4k, B = 8 up to kv 1k -> 64 rows; B = 2 kv 16k, B = 8 kv 4k -> 128.
//   Measured (H200, docs/architecture.md): B = 1 kv 1k / 4k / 16k 13.0 -> 9.9, 16.6 -> 13.4,
//   29.7 -> 27.5 us; B = 8 kv 1k 26.6 -> 24.9; past the bound 8-30 % slower (B = 2 kv 16k 43 ->
//   47, B = 8 kv 4k 50 -> 53, B = 1 kv 64k 73 -> 83).
inline bool narrow_query_tiles(int64_t num_reqs, int64_t num_kv_heads, int64_t kv_capacity,
                               int64_t sms, bool automatic_splits) {
  const int64_t heads = num_reqs * num_kv_heads;  // divided, not multiplied: no overflow
  return automatic_splits && kv_capacity <= 1024 * sms / (heads > 0 ? heads : 1);
}

// Few (request, KV head) pairs over short KV under automatic splits, on the wgmma path with
// 64-row query tiles and head_dim 128 (the 32/8 x 128 layout at B = 1): 32-key KV tiles and ONE
// CTA per SM (auto_splits with 1 CTA per SM) instead of 64-key tiles at two per SM. There the op
// is a latency chain of a few KV tiles per split; a CTA alone on its SM and 32-key tiles shorten
// it. Applies where B * Hkv * 16 <= SMs (at least 16 splits per pair) and the block table holds
// at most 256 keys per SM in all.
//   132 SMs, 8 KV heads: B = 1 up to kv 4224 (16 splits); B = 2 or a wider table -> the default.
//   Measured, rule vs the default in one run (docs/architecture.md): H200 kv 1k 10.95 -> 10.47 us,
//   kv 4k 16.81 -> 15.92, but kv 8k 21.20 -> 23.54 and kv 16k 31.21 -> 37.96 (hence 256 keys per
//   SM, not 1024); H100 kv 1k / 4k / 8k / 16k 10.78 / 17.17 / 24.90 / 38.52 -> 10.72 / 16.66 /
//   24.04 / 38.60.
inline bool single_cta_splits(int64_t num_reqs, int64_t num_kv_heads, int64_t kv_capacity,
                              int64_t sms, bool automatic_splits) {
  const int64_t heads = num_reqs * num_kv_heads;
  return automatic_splits && heads > 0 && heads * 16 <= sms && kv_capacity <= 256 * sms / heads;
}

// Automatic KV splits (num_splits = 0): fill ONE wave of resident CTAs, splits = floor(SMs *
// CTAs per SM / CTAs without splitting), clamped to [1, max_auto] and to the grid limit. The
// device then shrinks a request's splits to its KV length (at least 2 KV tiles per split).
//   B = 1, 32/8 x 128 (2 CTAs per SM): 264 / 8 = 33 splits of a 16k-key request (~8 tiles each);
//   B = 64: 264 / 512 = 0 -> 1 (no split, no merge kernel).
inline int32_t auto_splits(int64_t sms, int64_t ctas_per_sm, int64_t base_ctas, int64_t grid_cap,
                           int64_t max_auto) {
  int64_t s = base_ctas > 0 ? (sms * ctas_per_sm) / base_ctas : 1;
  s = s > grid_cap ? grid_cap : s;
  s = s < 1 ? 1 : (s > max_auto ? max_auto : s);
  return static_cast<int32_t>(s);
}

// Cluster merge (sm_90+): CTAs per thread-block cluster along the KV axis for a plan of `splits`
// splits -- the largest power of two <= min(splits, max_cluster) (8: the portable limit). The
// kernel merges a cluster's splits through distributed shared memory, each rank taking
// block_m / cluster rows, so the cluster size divides the 64/128-row tile.
//   33 automatic splits -> 8; num_splits = 3 -> 2 (two clusters, the fourth CTA idle); 1 -> 1.
inline int32_t cluster_size(int64_t splits, int64_t max_cluster) {
  int64_t c = 1;
  while (c * 2 <= splits && c * 2 <= max_cluster) c *= 2;
  return static_cast<int32_t>(c);
}

// Splits that one wave of clusters holds: clusters per tile = resident clusters (the device's
// cudaOccupancyMaxActiveClusters) / tiles, at least 1 and at most what `splits` (the one-wave CTA
// count of auto_splits) needs, times the cluster size.
//   B = 1, 32/8 x 128, 8-CTA clusters, 33 splits wanted: 32 resident clusters / 8 tiles = 4
//   clusters -> 32 splits (256 CTAs, one wave); 30 resident -> 3 clusters -> 24 splits.
inline int32_t cluster_splits(int64_t active_clusters, int64_t cluster, int64_t base_ctas,
                              int64_t splits) {
  if (active_clusters < 1 || cluster < 2) return 0;
  const int64_t need = (splits + cluster - 1) / cluster;
  int64_t per = base_ctas > 0 ? active_clusters / base_ctas : 1;
  per = per < 1 ? 1 : (per > need ? need : per);
  return static_cast<int32_t>(per * cluster);
}

// CTAs that write the rows outside every request (a padded tail; B == 0): a few, striding.
inline int32_t inert_ctas(int64_t num_tokens, int64_t max_ctas) {
  const int64_t n = num_tokens > 1 ? num_tokens : 1;
  return static_cast<int32_t>(n < max_ctas ? n : max_ctas);
}

}  // namespace paged_attention_heuristics
}  // namespace peagle
