"""Run-to-run spread of ``peagle bench e2e``: the same grid run again, back to back.

The default pair's decode steps are short (about 1-5 ms), and a concurrency-64 config of 64
prompts x 128 tokens lasts a fraction of a second, so one run's tokens/s moves by tens of percent
between runs of the same tree. ``benchmarks/results/e2e-h200-repeat*.json`` hold repeats of
``e2e-h200.json`` (same settings and commit); :func:`section` renders per config every run, the
median and the spread, and the goals' ratios per run and on the medians.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

REPEAT_GLOB = "e2e-h200-repeat*.json"


def find(results: Path, main: dict) -> list[dict]:
    """The repeat files in ``results`` with ``main``'s settings (others are skipped)."""
    out = []
    for p in sorted(results.glob(REPEAT_GLOB)):
        d = json.loads(p.read_text())
        if d.get("settings") == main.get("settings"):
            out.append(d)
    return out


def median_rows(runs: list[dict]) -> list[dict]:
    """The first run's rows with ``tokens_per_s`` replaced by the median over ``runs`` (configs
    missing from a run are left out)."""
    keys = [k for k in runs[0]["configs"] if all(k in r["configs"] for r in runs)]
    rows = []
    for k in keys:
        row = dict(runs[0]["configs"][k])
        row["tokens_per_s"] = statistics.median(r["configs"][k]["tokens_per_s"] for r in runs)
        rows.append(row)
    return rows


def section(main: dict, repeats: list[dict]) -> list[str]:
    """docs/results.md lines: per concurrency, every run's tokens/s per config, the median and
    the spread ((max - min) / median), then best K and the ratios per run and on the medians."""
    from peagle.bench import tune

    if not repeats:
        return []
    runs = [main, *repeats]
    n = len(runs)
    commits = sorted({str(r.get("commit")) for r in runs})
    lines = [
        f"### Run-to-run spread ({n} runs of the same grid, back to back)",
        "",
        f"Commit{'s' if len(commits) > 1 else ''} {', '.join(f'`{c}`' for c in commits)}; run 1 "
        "is the file above, runs 2.. are `benchmarks/results/e2e-h200-repeat*.json`. Spread = "
        "(max - min) / median of the runs' tokens/s. Read the goals from the medians.",
        "",
    ]
    med = median_rows(runs)
    for c in tune.concurrencies(med):
        keys = [
            k for k, row in runs[0]["configs"].items()
            if row["concurrency"] == c and all(k in r["configs"] for r in runs)
        ]  # fmt: skip
        order = lambda k: (runs[0]["configs"][k]["method"] != "none",
                           runs[0]["configs"][k]["method"], runs[0]["configs"][k]["k"])  # fmt: skip
        keys.sort(key=order)
        lines += [f"Concurrency {c}:", "",
                  "| method | K | " + " | ".join(f"run {i + 1}" for i in range(n))
                  + " | median | spread |",
                  "|---|---|" + "---|" * (n + 2)]  # fmt: skip
        for k in keys:
            tps = [r["configs"][k]["tokens_per_s"] for r in runs]
            m = statistics.median(tps)
            row = runs[0]["configs"][k]
            lines.append(
                f"| {row['method']} | {row['k']} | "
                + " | ".join(f"{t:.0f}" for t in tps)
                + f" | {m:.0f} | {100 * (max(tps) - min(tps)) / m:.0f} % |"
            )
        per_run = [tune.analyse(tune.measured_rows(r), c) for r in runs]
        a = tune.analyse(med, c)
        lines += ["", "| | " + " | ".join(f"run {i + 1}" for i in range(n)) + " | medians |",
                  "|---|" + "---|" * (n + 1)]  # fmt: skip
        for label, get in _summary_cells():
            lines.append(f"| {label} | " + " | ".join(get(x) for x in [*per_run, a]) + " |")
        lines.append("")
    return lines


def _summary_cells():
    def best(m):
        def cell(a):
            b = a["best"].get(m)
            if b is None:
                return "—"
            sp = "" if b["speedup"] is None else f", {b['speedup']:.2f}x none"
            return f"K={b['k']} {b['tokens_per_s']:.0f}{sp}"

        return cell

    ratio = lambda a: "—" if a["peagle_over_eagle3"] is None else f"{a['peagle_over_eagle3']:.2f}x"
    return [("P-EAGLE best", best("peagle")), ("EAGLE-3 best", best("eagle3")),
            ("P-EAGLE / EAGLE-3", ratio)]  # fmt: skip
