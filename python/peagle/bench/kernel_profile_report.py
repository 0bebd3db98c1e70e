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


def load_lines(results: Path, family: str) -> list[dict]:
    """The per-instruction profiles of ``family`` (``profile-<family>-*-lines-h200.json``, written
    from ``tools/ncu_lines.py --json`` output), in file-name order."""
    return [json.loads(f.read_text())
            for f in sorted(results.glob(f"profile-{family}-*-lines-h200.json"))]  # fmt: skip


def _kernel_name(signature: str) -> str:
    """``void f<(T)2, 1>(A, B)`` -> ``void f<(T)2, 1>``: the parameter list (the last balanced
    parentheses) dropped."""
    if not signature.endswith(")"):
        return signature
    depth = 0
    for i in range(len(signature) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(signature[i], 0)
        if depth == 0:
            return signature[:i]
    return signature


def lines_section(profiles: list[dict], top: int = 12) -> list[str]:
    """Markdown: per profile, where one kernel's executed instructions and stall samples come
    from, by source function (the ``top`` ones with the most stall samples)."""
    out: list[str] = []
    for d in profiles:
        samples = d["samples"] or 1.0
        stalls = ", ".join(f"{k} {100 * v / samples:.0f} %"
                           for k, v in list(d["stall_totals"].items())[:4])  # fmt: skip
        out += [
            f"Per source function of one `{_kernel_name(d['kernel'])}` launch ({d['case']}; GPU "
            f"{d['gpu']}, commit `{d['commit']}`; command: `{d['command']}`): "
            f"{d['distinct']} distinct instructions executed, {d['warp_instr']:.0f} warp "
            f"instructions, {d['samples']:.0f} stall samples ({stalls}).",
            "",
            "| function | distinct instructions | warp instructions | stall samples % | "
            "top stall reasons |",
            "|---|---|---|---|---|",
        ]
        for f in sorted(d["functions"], key=lambda f: -f["samples"])[:top]:
            reasons = ", ".join(f"{k} {v:.0f}" for k, v in f["top_stalls"].items())
            out.append(f"| `{f['function']}` | {f['distinct']} | {f['warp_instr']:.0f} | "
                       f"{100 * f['samples'] / samples:.1f} | {reasons} |")  # fmt: skip
        out.append("")
    return out
