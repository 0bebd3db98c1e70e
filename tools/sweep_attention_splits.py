"""Sweep paged_attention's num_splits on the B=1 decode shapes (graph-timed, L2 rotated), to check
the automatic split count against fixed ones. Prints one line per (shape, splits).

    python3 tools/sweep_attention_splits.py
"""

from __future__ import annotations

import torch

from peagle import ops
from peagle.bench.timing import bench_graph, l2_rotation_sets


def sweep(b: int, hq: int, hkv: int, d: int, kv: int, g: torch.Generator) -> None:
    q_len, page = 14, 16
    nblk = b * kv // page
    kv_bytes = 2 * nblk * page * hkv * d * 2
    sets = []
    for _ in range(l2_rotation_sets(kv_bytes, factor=3, max_sets=8)):
        kc = torch.randn(nblk, page, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
        vc = torch.randn(nblk, page, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
        bt = torch.randperm(nblk, device="cuda", generator=g).to(torch.int32).view(b, -1)
        sets.append((kc, vc, bt))
    q = torch.randn(b * q_len, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    qsl = torch.arange(b + 1, device="cuda", dtype=torch.int32) * q_len
    sl = torch.full((b,), kv, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    for splits in (0, 4, 8, 12, 16, 24, 32, 48, 64):

        def fn(i: int, splits: int = splits) -> None:
            kc, vc, bt = sets[i % len(sets)]
            ops.paged_attention(q, kc, vc, bt, qsl, sl, max_query_len=q_len,
                                num_splits=splits, out=out)  # fmt: skip

        us = bench_graph(fn, calls_per_graph=2 * len(sets), replays=50)
        print(f"B={b} {hq}/{hkv}x{d} kv={kv} splits={splits or 'auto'}: {us:.2f} us "
              f"{kv_bytes / us / 1e3:.0f} GB/s", flush=True)  # fmt: skip


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in ((1, 32, 8, 128, 16384), (1, 64, 8, 64, 16384),
                  (1, 32, 8, 128, 4096), (1, 64, 8, 64, 4096)):  # fmt: skip
        sweep(*shape, g)


if __name__ == "__main__":
    main()
