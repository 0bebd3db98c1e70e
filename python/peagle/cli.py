"""The ``peagle`` command line (also ``python -m peagle``): ``generate``, ``train``, ``demo``.

Each subcommand lives in ``peagle.commands.<name>`` and provides ``add_parser(subparsers)`` and
``run(args) -> int``; add a new one by appending it to ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS = ("generate", "train", "demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="peagle",
        description="P-EAGLE parallel speculative decoding on peagle's fused ops.",
        epilog="examples: peagle generate --help; peagle train --help; peagle demo --device cpu",
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
