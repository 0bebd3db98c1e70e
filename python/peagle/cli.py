"""The `peagle` command line: `peagle demo` (more subcommands are added as they land)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        prog="peagle",
        description="P-EAGLE parallel speculative decoding (peagle).",
        epilog="example: peagle demo --device cpu",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run one P-EAGLE step through every op on sample inputs",
                   add_help=False)  # fmt: skip
    args, rest = ap.parse_known_args(argv)
    if args.command == "demo":
        from peagle.demo import main as demo_main

        demo_main(rest)


if __name__ == "__main__":
    main()
