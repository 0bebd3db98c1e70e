"""Quick H200 timing of peagle.verify_chain alone (no peers), the issue-21 cases.

Same inputs and method as ``peagle bench ops verify`` (CUDA graph of N calls, replay / N, median
of 100 replays, rotating input sets for a cold L2), but only peagle, so one run takes seconds.
Prints one line per case, then a JSON dict of medians (µs).

    python3 tools/time_verify.py                 # the five issue-21 cases
    python3 tools/time_verify.py --reps 2        # each case twice (same-variant spread)
    python3 tools/time_verify.py --batch 16 32   # only V=201088 T=0.7 at these batch sizes
    python3 tools/time_verify.py --filtered      # only the top-k / top-p cases
    python3 tools/time_verify.py --accept 0.6 1  # B=8 / 64 T=0.7, drafts accepted w.p. 0.6 / 1
"""

from __future__ import annotations

import argparse
import json

import torch

from peagle.bench.timing import bench_graph, l2_rotation_sets
from peagle.bench.verify_chain import Peagle, accept_of, make_set

CASES = [
    (64, 201088, "greedy", 0.0, None),
    (64, 201088, "T=0.7", 0.7, None),
    (64, 201088, "T=0.7,top_k=50,top_p=0.9", 0.7, (50, 0.9)),
    (1, 201088, "greedy", 0.0, None),
    (1, 201088, "T=0.7", 0.7, None),
    (1, 201088, "T=0.7,top_k=50,top_p=0.9", 0.7, (50, 0.9)),
    (8, 201088, "T=0.7", 0.7, None),
]
FILTERED = [
    (64, 201088, "T=0.7,top_k=50,top_p=0.9", 0.7, (50, 0.9)),
    (64, 201088, "T=0.7,top_k=50", 0.7, (50, 1.0)),
    (64, 201088, "T=0.7,top_p=0.9", 0.7, (0, 0.9)),
    (8, 201088, "T=0.7,top_k=50,top_p=0.9", 0.7, (50, 0.9)),
    (1, 201088, "T=0.7,top_k=50,top_p=0.9", 0.7, (50, 0.9)),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--batch", type=int, nargs="*", help="only V=201088 T=0.7 at these B")
    ap.add_argument("--filtered", action="store_true", help="only the top-k / top-p cases")
    ap.add_argument("--accept", nargs="*", help="only B=8 / 64 T=0.7 with drafts accepted "
                    "with these probabilities (1: always)")  # fmt: skip
    args = ap.parse_args()
    cases = [(b, 201088, "T=0.7", 0.7, None) for b in args.batch] if args.batch else CASES
    if args.filtered:
        cases = FILTERED
    if args.accept:
        cases = [(b, 201088, f"T=0.7,accept={a}", 0.7, None) for a in args.accept for b in (8, 64)]
    res: dict[str, list[float]] = {}
    for _ in range(args.reps):
        for b, v, mode, temp, top in cases:
            logit_bytes = b * 8 * v * 2
            n_sets = l2_rotation_sets(logit_bytes)
            accept = accept_of(mode)
            sets = [make_set(b, v, temp, top, seed=i, accept=accept) for i in range(n_sets)]
            pe = Peagle(b)
            calls = 10 if b * v < 64 * 151936 else 5
            t = bench_graph(lambda i, pe=pe, sets=sets: pe(sets[i % len(sets)]), calls,
                            args.replays)  # fmt: skip
            name = f"B={b},{mode}"
            res.setdefault(name, []).append(round(t, 2))
            print(f"{name:32s} {t:8.2f} us  {logit_bytes / t / 1e3:6.0f} GB/s", flush=True)
            del sets
            torch.cuda.empty_cache()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
