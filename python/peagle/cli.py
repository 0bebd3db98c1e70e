"""The ``peagle`` command line (also ``python -m peagle``): ``generate``, ``train``, ``demo``,
``bench``, ``tune``.

Each subcommand lives in ``peagle.commands.<name>`` and provides ``add_parser(subparsers)`` and
``run(args) -> int``; add a new one by appending it to ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS = ("generate", "train", "demo", "bench", "tune")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="peagle",
        description="P-EAGLE parallel speculative decoding on peagle's fused ops.",
        epilog="examples:\n"
        "  peagle generate --prompt 'def parse_header(line):' --max-new-tokens 64\n"
        "  peagle train --help\n"
        "  peagle demo --device cpu\n"
        "  peagle bench ops all                     # ops vs their peers (CUDA)\n"
        "  peagle bench e2e --device cuda --max-minutes 8.5   # P-EAGLE vs EAGLE-3 vs none\n"
        "  peagle bench report                      # docs/results.md + plots\n"
        "  peagle tune --results benchmarks/results/e2e-h200.json --concurrency 1",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"peagle.commands.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
