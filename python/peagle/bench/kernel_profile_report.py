"""The per-kernel ncu profile (``benchmarks/results/profile-kernels-h200.json``, written by
``tools/profile_kernels.py summarize``) as docs/results.md tables, one per op family."""

from __future__ import annotations

import json
from pathlib import Path

FILE = "profile-kernels-h200.json"
# what tools/profile_kernels.py runs (its case names give only what varies)
CASES = {
    "verify": "K=7, V=201088, bf16 logits x 3, half the drafts their row's argmax",
    "attention": "q_len 14, page 16, shuffled pages, bf16",
}


def load(results: Path) -> dict | None:
    f = results / FILE
    return json.loads(f.read_text()) if f.is_file() else None


def _fmt(x, digits: int = 1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def section(d: dict, family: str) -> list[str]:
    """Markdown lines for ``family`` ("verify" / "attention"); [] when the file has none."""
    profiles = [p for p in d.get("profiles", []) if p["family"] == family]
    if not profiles:
        return []
    several = len(profiles) > 1
    note = f" {d['note'][0].upper()}{d['note'][1:]}." if d.get("note") else ""
    lines = [
        f"Per kernel under `{d['tool']}` ({CASES.get(family, family)}; GPU {d['gpu']}, commit "
        f"`{d['commit']}`; command: "
        f"`{d['command']}`). ncu runs kernels one at a time with cold caches and the clocks "
        "left alone, so a kernel of a few microseconds takes longer here than in the graph "
        f"replays above: read the split between kernels and what limits each one.{note}",
        "",
        "| case |" + (" variant |" if several else "") + " kernel | grid | block | regs | "
        "ncu µs | DRAM % of peak | SM % of peak | achieved occupancy % | DRAM read MB |",
        "|---|" + ("---|" if several else "") + "---|---|---|---|---|---|---|---|---|",
    ]
    for p in profiles:
        for r in p["rows"]:
            variant = f" {p['label']} |" if several else ""
            lines.append(
                f"| {r['case']} |{variant} `{r['kernel']}` | {r['grid']} | {r['block']} | "
                f"{_fmt(r.get('registers'), 0)} | {_fmt(r.get('time_us'))} | "
                f"{_fmt(r.get('dram_pct'))} | {_fmt(r.get('sm_pct'))} | "
                f"{_fmt(r.get('occupancy_pct'))} | {_fmt(r.get('dram_read_mb'))} |"
            )
    return lines + [""]
