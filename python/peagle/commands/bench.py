"""``peagle bench``: kernel benchmarks against their peers, end-to-end decode, docs report."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from peagle.errors import UserError

DESCRIPTION = """\
Benchmarks that users can rerun (method: docs/benchmarks.md).

  ops     every op against its peer in the same run, on a CUDA GPU: prepare_draft_inputs vs a
          vLLM-style multi-op path (+ a gather floor), verify_chain vs a vLLM-style multi-op
          sampler, paged_attention vs torch SDPA / FlexAttention, write_kv_cache vs torch
          index_copy_. Writes benchmarks/results/<short name>-h200.json (prep, verify,
          attention, kv).
  e2e     decode with the packaged default pair: P-EAGLE vs EAGLE-3 vs no speculation per K and
          concurrency, on held-out prompts (tokens/s, TPOT, acceptance length); resumable
          chunks; --projection adds a labelled projection for a ~1B target.
  report  docs/results.md tables and docs/*.png plots from the results JSON files."""

EPILOG = """\
examples:
  peagle bench ops all                                   # every op: prep-, verify-, attention-,
                                                         # kv-h200.json
  peagle bench ops prepare_draft_inputs --out benchmarks/results/prep-h200.json
  peagle bench ops paged_attention --filter h32-8 --no-flex --out /tmp/attention.json
  (short names: prep = prepare_draft_inputs, verify = verify_chain, attention = paged_attention,
   kv = write_kv_cache)
  peagle bench e2e --device cuda --out benchmarks/results/e2e-h200.json --max-minutes 8.5
  peagle bench e2e --device cuda --projection --projection-only --max-minutes 8.5
  peagle bench e2e --device cpu --k 1 3 --concurrency 1 2 --num-prompts 2 \\
      --max-new-tokens 16 --out e2e-cpu.json
  peagle bench report                                    # rewrite docs/results.md + plots
  peagle tune --results benchmarks/results/e2e-h200.json --concurrency 1
"""

# op -> (benchmark module, short name: an alias on the command line and the result file's name).
FAMILIES = {
    "prepare_draft_inputs": ("peagle.bench.prepare_draft_inputs", "prep"),
    "verify_chain": ("peagle.bench.verify_chain", "verify"),
    "paged_attention": ("peagle.bench.paged_attention", "attention"),
    "write_kv_cache": ("peagle.bench.write_kv_cache", "kv"),
}
_BY_NAME = {n: f for f, (_, short) in FAMILIES.items() for n in (f, short)}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="benchmarks: ops vs peers, end-to-end decode, docs report",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    sub.required = True

    ops = sub.add_parser(
        "ops",
        help="every op against its peer in the same run (CUDA)",
        description="Time peagle's ops and their peers in one process on the same inputs "
        "(CUDA graphs, CUDA events, medians, cold L2; docs/benchmarks.md). Needs a CUDA GPU.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fam = ops.add_subparsers(dest="family", metavar="FAMILY")
    fam.required = True
    for name, (module, short) in FAMILIES.items():
        mod = importlib.import_module(module)
        fp = fam.add_parser(
            name,
            aliases=[short],
            help=mod.DESCRIPTION,
            description=mod.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.add_arguments(fp)
        fp.set_defaults(run=run_ops)
    allp = fam.add_parser("all", help="every family with its default cases")
    allp.add_argument(
        "--out-dir",
        default="benchmarks/results",
        help="writes <short name>-<gpu-tag>.json here (prep, verify, attention, kv; default: "
        "%(default)s)",
    )
    allp.add_argument("--gpu-tag", default="h200", help="file-name tag (default: %(default)s)")
    allp.add_argument("--no-flex", action="store_true", help="attention: skip FlexAttention")
    allp.set_defaults(run=run_ops)

    e2e = sub.add_parser(
        "e2e",
        help="decode throughput: P-EAGLE vs EAGLE-3 vs none (default pair)",
        description=_plain(importlib.import_module("peagle.bench.e2e").__doc__),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    importlib.import_module("peagle.bench.e2e").add_arguments(e2e)
    e2e.set_defaults(run=run_e2e)

    rep = sub.add_parser(
        "report",
        help="rewrite docs/results.md and the docs/*.png plots from the results JSON",
        description="Rewrite docs/results.md and docs/kernels-h200.png, "
        "docs/e2e-tokens-per-s-vs-k.png, docs/e2e-speedup-vs-concurrency.png from "
        "benchmarks/results/*-h200.json, and a section with docs/released-<shape>-*.png per "
        "benchmarks/results/released-*-h200.json (needs matplotlib for the plots).",
    )
    rep.add_argument("--results-dir", default="benchmarks/results",
                     help="where the *-h200.json results are (default: %(default)s)")  # fmt: skip
    rep.add_argument("--docs-dir", default="docs",
                     help="where results.md and the PNGs go (default: %(default)s)")  # fmt: skip
    rep.set_defaults(run=run_report)
    return p


def _plain(doc: str | None) -> str:
    """A docstring for --help: Sphinx roles and inline-literal backquotes removed."""
    import re

    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc or "")
    return text.replace("``", "")


def _require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise UserError(
            "bench ops",
            "needs a CUDA GPU (torch.cuda.is_available() is False): the op benchmarks time CUDA "
            "kernels and their peers with CUDA events and CUDA graphs",
            "on the CPU, run `peagle bench e2e --device cpu` or the tests instead",
        )


def run_ops(args) -> int:
    _require_cuda()
    if args.family != "all":
        importlib.import_module(FAMILIES[_BY_NAME[args.family]][0]).run(args)
        return 0
    failed = []
    for name, (module, short) in FAMILIES.items():
        mod = importlib.import_module(module)
        fp = argparse.ArgumentParser()
        mod.add_arguments(fp)
        out = str(Path(args.out_dir) / f"{short}-{args.gpu_tag}.json")
        extra = ["--no-flex"] if name == "paged_attention" and args.no_flex else []
        print(f"=== peagle bench ops {name} -> {out}", flush=True)
        try:
            mod.run(fp.parse_args(["--out", out, *extra]))
        except Exception as e:  # noqa: BLE001  (report, run the other families, fail at the end)
            import traceback

            traceback.print_exc()
            failed.append(f"{name}: {type(e).__name__}: {e}")
    if failed:
        raise SystemExit("peagle bench ops all: failed families:\n  " + "\n  ".join(failed))
    return 0


def run_e2e(args) -> int:
    from peagle.bench import e2e

    return e2e.run(args)


def run_report(args) -> int:
    from peagle.bench import report

    results = Path(args.results_dir)
    if not sorted(results.glob("*-h200.json")):
        raise UserError(
            f"bench report --results-dir {results}",
            "no *-h200.json results there; nothing written",
            "run `peagle bench ops` / `peagle bench e2e` first, or pass --results-dir",
        )
    report.generate(results, Path(args.docs_dir))
    return 0
