"""The ``peagle`` command line (also ``python -m peagle``): ``generate``, ``train``, ``demo``,
``bench``, ``tune``.

Each subcommand lives in ``peagle.commands.<name>`` and provides ``add_parser(subparsers)`` and
``run(args) -> int``; add a new one by appending it to ``COMMANDS``. A user error (a bad flag, a
missing file, a device this machine lacks) is raised as :class:`peagle.errors.UserError` and
printed here as one ``peagle: <what>: <why> (<what to do>)`` line, exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from peagle.errors import EXIT_USAGE, UserError

COMMANDS = ("generate", "train", "demo", "bench", "tune")


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one ``peagle:`` line (subparsers inherit the class)."""

    def error(self, message: str):  # noqa: D102  (argparse API)
        what = self.prog.removeprefix("peagle").strip() or "usage"
        raise UserError(what, message, f"see {self.prog} --help")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("peagle")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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
    parser.add_argument("--version", action="version", version=f"peagle {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"peagle.commands.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args, extra = build_parser().parse_known_args(argv)
        if extra:  # argparse would report a subcommand's unknown flags as the top level's
            raise UserError(
                args.command,
                f"unrecognized arguments: {' '.join(extra)}",
                f"see peagle {args.command} --help",
            )
        return int(args.run(args) or 0)
    except UserError as e:
        print(f"peagle: {e.line()}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("peagle: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader left (`peagle tune ... | head`): stop quietly, like a pipe-aware tool, and
        # keep Python's exit-time flush of stdout from raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the signal


if __name__ == "__main__":
    sys.exit(main())
