"""Sweep paged_attention's launch choices on P-EAGLE decode shapes (graph-timed, L2 rotated): the
KV split count (``num_splits``; 0 = automatic) and the kernel variant (``PEAGLE_ATTN_IMPL``,
read at every call, so at graph capture), to check the automatic choices against fixed ones.
Prints one line per (shape, impl, splits); ``--out`` also writes the rows as a results file.

    python3 tools/sweep_attention_splits.py                      # B=1 split sweep (default)
    python3 tools/sweep_attention_splits.py --shapes 1:64:8:64:1024 2:64:8:64:4096 \
        --impls auto wgmma-n32 --splits 0 --out $OUT/tiles.json  # tile variants, auto splits
"""

from __future__ import annotations

import argparse
import os

import torch

from peagle import ops
from peagle.bench.timing import Results, bench_graph, copy_ceiling_gbps, l2_rotation_sets

DEFAULT_SHAPES = ["1:32:8:128:16384", "1:64:8:64:16384", "1:32:8:128:4096", "1:64:8:64:4096"]
DEFAULT_SPLITS = [0, 4, 8, 12, 16, 24, 32, 48, 64]
Q_LEN, PAGE = 14, 16


def sweep(shape: str, impls: list[str], splits_list: list[int], g: torch.Generator,
          res: Results) -> None:  # fmt: skip
    b, hq, hkv, d, kv = (int(x) for x in shape.split(":"))
    nblk = b * (-(-kv // PAGE))
    kv_bytes = 2 * b * kv * hkv * d * 2
    sets = []
    for _ in range(l2_rotation_sets(2 * nblk * PAGE * hkv * d * 2, factor=3, max_sets=8)):
        kc = torch.randn(nblk, PAGE, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
        vc = torch.randn(nblk, PAGE, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
        bt = torch.randperm(nblk, device="cuda", generator=g).to(torch.int32).view(b, -1)
        sets.append((kc, vc, bt))
    q = torch.randn(b * Q_LEN, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    qsl = torch.arange(b + 1, device="cuda", dtype=torch.int32) * Q_LEN
    sl = torch.full((b,), kv, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    case = f"B{b}_q{Q_LEN}_h{hq}-{hkv}_d{d}_kv{kv}"
    ref = None
    for impl in impls:
        if impl == "auto":
            os.environ.pop("PEAGLE_ATTN_IMPL", None)
        else:
            os.environ["PEAGLE_ATTN_IMPL"] = impl
        for splits in splits_list:

            def fn(i: int, splits: int = splits) -> None:
                kc, vc, bt = sets[i % len(sets)]
                ops.paged_attention(q, kc, vc, bt, qsl, sl, max_query_len=Q_LEN,
                                    num_splits=splits, out=out)  # fmt: skip

            fn(0)
            torch.cuda.synchronize()
            if ref is None:
                ref = out.float().clone()
            err = (out.float() - ref).abs().max().item()
            if not err <= 0.05:
                raise SystemExit(f"{case} impl={impl} splits={splits}: max diff {err} vs first")
            us = bench_graph(fn, calls_per_graph=2 * len(sets), replays=50)
            gbps = kv_bytes / us / 1e3
            res.add(case, impl, us, gbps, num_splits=splits)
            print(f"{case} impl={impl} splits={splits or 'auto'}: {us:.2f} us {gbps:.0f} GB/s",
                  flush=True)  # fmt: skip
    os.environ.pop("PEAGLE_ATTN_IMPL", None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="B:Hq:Hkv:D:kv_len")
    ap.add_argument("--impls", nargs="+", default=["auto"],
                    help="PEAGLE_ATTN_IMPL values ('auto': unset)")  # fmt: skip
    ap.add_argument("--splits", nargs="+", type=int, default=DEFAULT_SPLITS, help="0 = automatic")
    ap.add_argument("--out", help="write the rows here (results-file format)")
    args = ap.parse_args()
    res = Results(copy_ceiling_gbps=copy_ceiling_gbps())
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes:
        sweep(shape, args.impls, args.splits, g, res)
    if args.out:
        res.write(args.out)


if __name__ == "__main__":
    main()
