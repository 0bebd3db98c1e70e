"""`peagle` command line (being written)."""


def main() -> None:
    raise SystemExit("peagle: CLI not built yet")
