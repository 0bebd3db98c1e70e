"""Benchmark: peagle.write_kv_cache (one launch for K and V) vs a torch ``index_copy_`` peer.

The peer writes the same rows the way a non-fused path does: ``index_copy_`` of K into the
flattened ``[num_blocks * block_size, Hkv, D]`` key cache at ``slot_mapping``, then the same for
V (two kernels). The peer has no rule for ``PADDING_SLOT_ID`` (-1) rows, so the cases are uniform
decode batches whose every row has a real slot: B requests x (K + 1) rows, K = 7, slots of
shuffled pages (page 16), heads 8 x 128 and 8 x 64, bf16. Both write the same inputs to their own
caches, compared before timing. Timing (PERF.md §4): CUDA graphs (N calls per graph, replay / N,
median), inputs rotated to touch several times the L2; GB/s counts K/V bytes read + written
(2 * T * Hkv * D * 2 B * 2); % is of the copy ceiling measured in the same run.

    peagle bench ops write_kv_cache --out benchmarks/results/kv-h200.json
"""

from __future__ import annotations

import argparse

import torch

from peagle import ops
from peagle.bench.timing import (
    Results,
    bench_eager,
    bench_graph,
    copy_ceiling_gbps,
    l2_rotation_sets,
    print_table,
)

FAMILY = "kv"
DESCRIPTION = __doc__.split("\n")[0]
K = 7
PAGE = 16
HEADS = [(8, 128), (8, 64)]
BATCHES = [1, 8, 64, 256]


class KVCase:
    """``n_sets`` input sets (K/V rows + slots) for B requests, and one cache per implementation."""

    def __init__(self, b, hkv, d, n_sets, ctx=1024, dtype=torch.bfloat16, device="cuda", seed=0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.t = b * (K + 1)
        blocks_per_req = -(-(ctx + K + 1) // PAGE)
        num_blocks = b * blocks_per_req + 1
        kw = {"device": device, "dtype": dtype}
        self.keys = [torch.randn(self.t, hkv, d, generator=g).to(**kw) for _ in range(n_sets)]
        self.values = [torch.randn(self.t, hkv, d, generator=g).to(**kw) for _ in range(n_sets)]
        self.slots = []
        for _ in range(n_sets):
            # Request r's rows sit at positions ctx .. ctx + K of its own shuffled pages.
            table = 1 + torch.randperm(num_blocks - 1, generator=g)[: b * blocks_per_req]
            table = table.view(b, blocks_per_req)
            pos = ctx + torch.arange(K + 1)
            slots = table[:, pos // PAGE] * PAGE + pos % PAGE
            self.slots.append(slots.reshape(-1).to(device=device, dtype=torch.int64))
        self.caches = {
            impl: (torch.zeros(num_blocks, PAGE, hkv, d, **kw),
                   torch.zeros(num_blocks, PAGE, hkv, d, **kw))
            for impl in ("peagle", "torch-index-copy")
        }  # fmt: skip
        self.nbytes = 2 * self.t * hkv * d * torch.finfo(dtype).bits // 8 * 2

    def peagle(self, i):
        s = i % len(self.keys)
        kc, vc = self.caches["peagle"]
        ops.write_kv_cache(self.keys[s], self.values[s], kc, vc, self.slots[s])

    def peer(self, i):
        s = i % len(self.keys)
        kc, vc = self.caches["torch-index-copy"]
        kc.view(-1, *kc.shape[2:]).index_copy_(0, self.slots[s], self.keys[s])
        vc.view(-1, *vc.shape[2:]).index_copy_(0, self.slots[s], self.values[s])

    def check(self) -> None:
        """Both implementations write every set; the caches must be identical."""
        for i in range(len(self.keys)):
            self.peagle(i)
            self.peer(i)
        for a, b in zip(self.caches["peagle"], self.caches["torch-index-copy"], strict=True):
            if not torch.equal(a, b):
                raise AssertionError("write_kv_cache and the index_copy_ peer disagree")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=BATCHES)
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--out", default=None, help="write JSON results here")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=DESCRIPTION)
    add_arguments(ap)
    run(ap.parse_args(argv))


def run(args: argparse.Namespace) -> None:
    ceiling = copy_ceiling_gbps()
    print(f"copy ceiling: {ceiling:.0f} GB/s (read + write)")
    res = Results(ceiling, extra={"k": K, "page_size": PAGE, "dtype": "bfloat16", "l2": "cold"})
    for hkv, d in HEADS:
        for b in args.batch_sizes:
            t = b * (K + 1)
            n_sets = l2_rotation_sets(2 * t * hkv * d * 2 * 2, max_sets=32)
            c = KVCase(b, hkv, d, n_sets, seed=b * 31 + d)
            c.check()
            case = f"B={b},K={K},T={t},Hkv={hkv},D={d}"
            calls = max(4, min(n_sets, 32))
            for impl, fn in (("peagle", c.peagle), ("torch-index-copy", c.peer)):
                us = bench_graph(fn, calls_per_graph=calls, replays=args.replays)
                gbps = c.nbytes / (us * 1e-6) / 1e9
                res.add(case, impl, us, gbps, pct_copy=round(100 * gbps / ceiling, 1),
                        mode="graph", input_sets=n_sets)  # fmt: skip
            us_e = bench_eager(c.peagle, iters=max(100, args.replays))
            res.add(case, "peagle-eager", us_e, c.nbytes / (us_e * 1e-6) / 1e9, mode="eager")
            del c
            torch.cuda.empty_cache()
    by = {(r["case"], r["impl"]): r["median_us"] for r in res.rows}
    for r in res.rows:
        peer = by.get((r["case"], "torch-index-copy"))
        if peer and r["impl"] == "peagle":
            r["speedup_vs_peer"] = round(peer / r["median_us"], 2)
    print_table(res.rows, ["case", "impl", "mode", "median_us", "gbps", "pct_copy",
                           "speedup_vs_peer"])  # fmt: skip
    if args.out:
        res.write(args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
