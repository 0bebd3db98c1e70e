"""``peagle tune``: the K that maximises tokens/s per method, and the break-even table."""

from __future__ import annotations

import argparse
import json

from peagle.errors import UserError

DESCRIPTION = """\
For a model pair, GPU and concurrency: the K with the most tokens/s for P-EAGLE and for EAGLE-3,
their speedup over no speculation, and the break-even table (per K: tokens/s of each method and
its speedup over no speculation; 'x' marks a K where speculation is slower than none). Reads the
results of `peagle bench e2e` (measured rows, and projected rows for a ~1B target when the file
has them, always labelled); --run measures first (same flags as `peagle bench e2e`)."""

EPILOG = """\
examples:
  peagle tune --results benchmarks/results/e2e-h200.json
  peagle tune --results benchmarks/results/e2e-h200.json --concurrency 1 --json
  peagle tune --run --device cuda --k 1 3 5 7 10 --concurrency 1 --results /tmp/e2e.json
  peagle tune --results benchmarks/results/released-gpt-oss-20b-h200.json --context 1024
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    from peagle.bench.e2e import DEFAULT_KS, METHODS

    p = subparsers.add_parser(
        "tune",
        help="best K per method and break-even table from e2e results",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--results", default="benchmarks/results/e2e-h200.json",
                   help="e2e results JSON (default: %(default)s)")  # fmt: skip
    p.add_argument("--concurrency", nargs="+", type=int, default=None,
                   help="only these concurrencies (default: every one in the file)")  # fmt: skip
    p.add_argument("--context", nargs="+", type=int, default=None,
                   help="only these contexts in prompt tokens, for files that record several "
                        "(the released-shape files: 1024 8192; default: each one)")  # fmt: skip
    p.add_argument("--no-projection", action="store_true", help="measured rows only")
    p.add_argument("--json", action="store_true", help="print the analysis as JSON")
    r = p.add_argument_group("measuring first (--run)")
    r.add_argument(
        "--run", dest="measure_first", action="store_true", help="run `peagle bench e2e` first"
    )
    r.add_argument("--device", default=None)
    r.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    r.add_argument("--k", nargs="+", type=int, default=list(DEFAULT_KS))
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--num-prompts", type=int, default=64)
    r.add_argument("--max-minutes", type=float, default=0.0)
    r.add_argument("--projection", action="store_true", help="also time the ~1B projection")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    from peagle.bench import tune

    if args.measure_first:
        from peagle.bench import e2e

        ap = argparse.ArgumentParser()
        e2e.add_arguments(ap)
        argv = ["--out", args.results, "--max-new-tokens", str(args.max_new_tokens),
                "--num-prompts", str(args.num_prompts), "--max-minutes", str(args.max_minutes),
                "--methods", *args.methods, "--k", *map(str, args.k)]  # fmt: skip
        if args.concurrency:
            argv += ["--concurrency", *map(str, args.concurrency)]
        if args.device:
            argv += ["--device", args.device]
        if args.projection:
            argv.append("--projection")
        e2e_args = ap.parse_args(argv)
        e2e_args.no_summary = True  # the tables are printed once, below
        rc = e2e.run(e2e_args)
        if rc != 0:
            return rc
    data = tune.load(args.results)
    tune.check_e2e(data, args.results)
    sets = [("measured", tune.measured_rows(data))]
    if not args.no_projection:
        sets.append((tune.projection_label(data), tune.projected_rows(data)))
    out = []
    for label, rows in sets:
        for c in args.concurrency or tune.concurrencies(rows):
            for ctx in args.context or tune.contexts(rows, c):
                a = tune.analyse(rows, c, ctx)
                if not (a["best"] or a["none_tokens_per_s"] is not None):
                    continue
                a["source"] = label
                a["projection"] = label != "measured"
                out.append(a)
                if not args.json:
                    print("\n".join(tune.format_analysis(a, label)))
    if args.json:
        print(json.dumps(out, indent=1))
    if not out:
        have = tune.concurrencies(tune.measured_rows(data))
        raise UserError(
            f"tune --results {args.results}",
            "no rows for these concurrencies / contexts",
            f"the file has concurrencies {' '.join(map(str, have)) or 'none'} (see --concurrency, "
            "--context)",
        )
    return 0
