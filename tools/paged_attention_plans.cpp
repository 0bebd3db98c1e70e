// Prints paged_attention's host-side launch plans (plan_paged_attention) for the benchmark shapes
// (B 1/8/64 x kv 1k/4k/16k x 64/8 x 64 and 32/8 x 128, q_len 14, page 16, fp16/bf16, num_splits
// auto/1/3) on a 132-SM sm_90 device. Without a GPU the occupancy queries fail (1 CTA per SM, no
// resident clusters: the merge-kernel plans); on the GPU it prints the real plans, the cluster
// merge included (cluster CxN: N clusters of C CTAs per tile; wsp: workspace partial slots; cnt:
// arrival counters). Build it against two commits and diff the outputs to show a change leaves a
// launch configuration as it was (docs/testing.md). PEAGLE_ATTN_MERGE=cluster prints the cluster
// merge's plans.
//
//   nvcc -std=c++17 -O1 --expt-relaxed-constexpr -arch=sm_90a -Icsrc/include -x cu \
//        tools/paged_attention_plans.cpp csrc/cuda/paged_attention.cu -o /tmp/plans && /tmp/plans
#include <cstdio>

#include "peagle/kernels/paged_attention.h"
using namespace peagle;
int main() {
  for (int b : {1, 8, 64})
    for (int kv : {1024, 4096, 16384})
      for (int lay = 0; lay < 2; ++lay)
        for (int dt = 1; dt <= 2; ++dt)
          for (int ns : {0, 1, 3}) {
            PagedAttentionParams p;
            p.num_reqs = b;
            p.num_tokens = int64_t(b) * 14;
            p.max_query_len = 14;
            p.num_q_heads = lay ? 32 : 64;
            p.num_kv_heads = 8;
            p.head_dim = lay ? 128 : 64;
            p.block_size = 16;
            p.log2_block_size = 4;
            p.max_blocks_per_seq = kv / 16;
            p.num_blocks = int64_t(b) * kv / 16;
            p.num_splits = ns;
            p.dtype = dt == 1 ? AttnDtype::kFloat16 : AttnDtype::kBFloat16;
            p.num_sms = 132;
            p.arch = 90;
            PagedAttentionPlan q = plan_paged_attention(p);
            printf(
                "B%d kv%d lay%d dt%d ns%d: m%d n%d impl%d qt%d ms%d ws%d inert%d grid%lld "
                "cluster%dx%d wsp%d cnt%d\n",
                b, kv, lay, dt, ns, q.block_m, q.block_n, q.impl, q.q_tile_ctas, q.max_splits,
                int(q.needs_workspace), q.inert_ctas, (long long)q.grid_ctas, q.cluster,
                q.cluster_count, q.ws_partials, int(q.needs_counters));
          }
}
