"""Result-row helpers shared by :mod:`peagle.bench.report` and :mod:`peagle.bench.plots` (a leaf:
imports nothing of peagle)."""

from __future__ import annotations

MODES = ("graph", "eager", "eager-throughput")


def mode_of(r: dict) -> str:
    """``graph`` / ``eager`` / ``eager-throughput``: the row's ``mode`` or its case suffix."""
    if "mode" in r:
        return r["mode"]
    suffix = r["case"].rsplit(",", 1)[-1]
    return suffix if suffix in MODES else "graph"


def case_of(r: dict) -> str:
    """The case without its timing-mode suffix."""
    head, _, suffix = r["case"].rpartition(",")
    return head if head and suffix in MODES else r["case"]
