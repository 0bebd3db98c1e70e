"""Compare the old-vs-new benchmark files of `tools/h200.sh ab` (docs/testing.md).

    python3 tools/ab_compare.py DIR [DIR ...] [--json OUT] [--old-commit C] [--new-commit C]

DIR holds `ab-<family>-<side><rep>.json` (the unpacked `ab.tgz`; several DIRs are merged, e.g.
two calls of one reservation); the sides are old, new and any AB_VARIANTS tree (named in letters
and underscores). For every case of the kernel families (peagle's graph-mode rows only) it prints
the old and new medians of each repeat, new/old of the best of each side, and the same-variant
spread (largest relative difference between two repeats of one side, PERF.md §4): a ratio within
the spread is no change; each variant gets the same table against old (its rows carry
"variant"). e2e rows compare tokens/s, acceptance length and the outputs' hash (old vs new).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

NAME = re.compile(r"ab-(?P<fam>[a-z_]+)-(?P<side>[A-Za-z_]+)(?P<rep>\d+)\.json$")


def load(dirs: list[Path]) -> dict[str, dict[str, list[dict]]]:
    runs: dict[str, dict[str, list[dict]]] = {}
    for d in dirs:
        for f in sorted(d.glob("ab-*.json")):
            m = NAME.search(f.name)
            if m:
                side = runs.setdefault(m["fam"], {}).setdefault(m["side"], [])
                side.append(json.loads(f.read_text()))
    return runs


def kernel_table(fam: str, sides: dict[str, list[dict]]) -> tuple[list[str], list[dict]]:
    # Graph-mode rows only: a family that also records eager timings (verify) must not have them
    # overwrite the graph medians of the same case.
    med = {s: [{r["case"]: r["median_us"] for r in d["rows"]
                if r["impl"] == "peagle" and r.get("mode", "graph") == "graph"} for d in ds]
           for s, ds in sides.items()}  # fmt: skip
    cases = [c for c in med["old"][0] if all(c in m for s in med for m in med[s])]
    lines, rows = [], []
    for c in cases:
        old, new = [m[c] for m in med["old"]], [m[c] for m in med["new"]]
        spread = max((max(v) - min(v)) / min(v) if len(v) > 1 else float("nan") for v in (old, new))
        ratio = min(new) / min(old)
        rows.append({"family": fam, "case": c, "old_us": old, "new_us": new,
                     "new_over_old": round(ratio, 4),
                     "same_variant_spread": round(spread, 4)})  # fmt: skip
        lines.append(f"  {c:44s} old {'/'.join(f'{x:.2f}' for x in old):>15s}  "
                     f"new {'/'.join(f'{x:.2f}' for x in new):>15s}  new/old {ratio:.3f}  "
                     f"spread {spread:.3f}")  # fmt: skip
    ratios = [r["new_over_old"] for r in rows]
    gm = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else float("nan")
    head = (f"{fam}: {len(rows)} cases, new/old geomean {gm:.3f} "
            f"(min {min(ratios):.3f}, max {max(ratios):.3f})")  # fmt: skip
    return [head, *lines], rows


def e2e_table(sides: dict[str, list[dict]]) -> tuple[list[str], list[dict]]:
    old, new = sides["old"][0]["configs"], sides["new"][0]["configs"]
    lines, rows = ["e2e (tokens/s, one run per side):"], []
    for k in old:
        if k not in new:
            continue
        a, b = old[k], new[k]
        same = a.get("outputs_sha1") == b.get("outputs_sha1")
        ratio = b["tokens_per_s"] / a["tokens_per_s"]
        rows.append({"family": "e2e", "case": k, "old_tok_s": a["tokens_per_s"],
                     "new_tok_s": b["tokens_per_s"], "new_over_old": round(ratio, 4),
                     "old_al": a["acceptance_length"], "new_al": b["acceptance_length"],
                     "same_outputs": same})  # fmt: skip
        lines.append(f"  {k:20s} old {a['tokens_per_s']:8.1f}  new {b['tokens_per_s']:8.1f}  "
                     f"new/old {ratio:.3f}  AL {a['acceptance_length']:.3f} / "
                     f"{b['acceptance_length']:.3f}  same outputs: {same}")  # fmt: skip
    return lines, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, help="write the comparison here")
    ap.add_argument("--old-commit", default="")
    ap.add_argument("--new-commit", default="")
    ap.add_argument(
        "--command",
        default="bash tools/h200.sh ab .ab/old attention prep verify e2e",
        help="the command that produced the runs, recorded in --json",
    )
    args = ap.parse_args(argv)
    runs = load(args.dirs)
    if not runs:
        raise SystemExit(f"no ab-<family>-<old|new><rep>.json files in {args.dirs}")
    out_rows = []
    for fam in sorted(runs):
        sides = runs[fam]
        if "old" not in sides or "new" not in sides:
            print(f"{fam}: only {sorted(sides)}")
            continue
        lines, rows = e2e_table(sides) if fam == "e2e" else kernel_table(fam, sides)
        print("\n".join(lines))
        out_rows += rows
        for var in sorted(set(sides) - {"old", "new"}):
            if fam == "e2e":
                continue
            lines, rows = kernel_table(fam, {"old": sides["old"], "new": sides[var]})
            print(f"variant {var} (as new):")
            print("\n".join(lines))
            out_rows += [{**r, "variant": var} for r in rows]
    if args.json:
        any_run = next(iter(next(iter(runs.values())).values()))[0]
        rec = {"gpu": any_run.get("gpu"), "old_commit": args.old_commit,
               "new_commit": args.new_commit,
               "command": args.command,
               "rows": out_rows}  # fmt: skip
        args.json.write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
