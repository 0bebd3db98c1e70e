"""Where a kernel's executed instructions and stall samples come from, per source function and
line: an ncu per-instruction profile (SASS) matched to a ``-lineinfo`` disassembly of the same
build. Made for latency chains such as verify_chain's decide_sample, whose time follows the
instructions one CTA walks through rather than bytes or throughput.

On the H200: ``bash tools/h200.sh lines KERNEL_REGEX CMD...`` (results in $OUT/lines.*). By hand:

    ncu --clock-control none -k regex:KERNEL --launch-skip 2 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats --warp-sampling-interval 0 \\
        --import-source yes -f -o prof CMD...
    ncu -i prof.ncu-rep --page source --csv --print-source sass > sass.csv
    cuobjdump -xelf all peagle_ops.so && for c in *.cubin; do nvdisasm -g -c $c; done > all.sass
    python tools/ncu_lines.py sass.csv all.sass --src csrc [--json lines.json]

The profile's instructions are matched to the listing's function with the same opcode sequence
(several instantiations share a name); a source line is credited to the function whose
definition precedes it in its file. ``distinct`` counts the instructions executed at least once
(the code a chain has to fetch), ``warp_instr`` the warp-level executions, ``samples`` the warp
stall samples (their top reasons alongside).
"""

from __future__ import annotations

import argparse
import bisect
import csv
import io
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

_FUNC_HEAD = re.compile(
    r"^(?:template\s*<.*>\s*)?(?:__device__|__global__|__host__|PEAGLE_HD|inline|static)\b"
)
_IDENT_CALL = re.compile(r"([A-Za-z_]\w*)\s*\(")
_NOT_NAMES = {"__launch_bounds__", "__align__", "alignas", "decltype", "sizeof"}


def parse_profile(text: str) -> tuple[str, list[dict]]:
    """``ncu --page source --csv --print-source sass`` -> (kernel name, one dict per instruction:
    op, executed, samples, stalls)."""
    rows = list(csv.reader(io.StringIO(text)))
    kernel = next((r[1] for r in rows if len(r) > 1 and r[0] == "Kernel Name"), "")
    hi = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    head = rows[hi]
    col = {name: i for i, name in enumerate(head)}
    stall_cols = [n for n in head if n.startswith("stall_") and "Not Issued" not in n]

    def num(r: list[str], name: str) -> float:
        i = col.get(name)
        v = r[i].replace(",", "") if i is not None and i < len(r) else ""
        return float(v) if v else 0.0

    out = []
    for r in rows[hi + 1 :]:
        if len(r) < 2 or not r[1].strip():
            continue
        out.append(
            {
                "op": opcode(r[1]),
                "executed": num(r, "Instructions Executed"),
                "samples": num(r, "Warp Stall Sampling (All Samples)"),
                "stalls": {n[6:]: num(r, n) for n in stall_cols if num(r, n)},
            }
        )
    return kernel, out


def opcode(sass: str) -> str:
    """The opcode of one SASS instruction (predicate and modifiers dropped)."""
    words = sass.strip().rstrip(";").split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def parse_listing(text: str) -> dict[str, list[tuple[str, str, int]]]:
    """``nvdisasm -g -c`` output -> {function: [(op, file, line) per instruction]}."""
    funcs: dict[str, list[tuple[str, str, int]]] = {}
    cur: list | None = None
    loc = ("", 0)
    for line in text.splitlines():
        m = re.match(r"\s*\.text\.(\S+):\s*$", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            loc = ("", 0)
            continue
        m = re.match(r'\s*//## File "([^"]+)", line (\d+)', line)
        if m:
            loc = (m.group(1), int(m.group(2)))
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m and cur is not None:
            cur.append((opcode(m.group(1)), *loc))
    return funcs


def match_function(profile: list[dict], funcs: dict) -> str:
    """The listing's function whose opcodes are the profile's, in order."""
    ops = [p["op"] for p in profile]
    for name, instrs in funcs.items():
        if len(instrs) >= len(ops) and [i[0] for i in instrs[: len(ops)]] == ops:
            return name
    raise SystemExit("no function of the listing has the profile's instructions (same build?)")


def function_starts(path: Path) -> list[tuple[int, str]]:
    """(line, name) of each function definition in a C++/CUDA source, in order."""
    lines = path.read_text(errors="replace").splitlines()
    starts = []
    for i, text in enumerate(lines):
        if not _FUNC_HEAD.match(text):
            continue
        names = [n for n in _IDENT_CALL.findall(text) if n not in _NOT_NAMES]
        if not names and i + 1 < len(lines):  # name on the next line (__launch_bounds__ heads)
            names = [n for n in _IDENT_CALL.findall(lines[i + 1]) if n not in _NOT_NAMES]
        if names:
            starts.append((i + 1, names[0]))
    return starts


def attribute(profile: list[dict], instrs: list[tuple[str, str, int]], src: Path | None) -> dict:
    """Per-function and per-line totals of the profile (instrs: the matched listing)."""
    starts: dict[str, list[tuple[int, str]]] = {}

    def func_of(path: str, line: int) -> str:
        base = Path(path).name
        if src is not None and base not in starts:
            hits = list(src.rglob(base))
            starts[base] = function_starts(hits[0]) if hits else []
        st = starts.get(base, [])
        i = bisect.bisect_right([s[0] for s in st], line) - 1
        return f"{base}:{st[i][1]}" if i >= 0 else base or "?"

    per_func: dict[str, dict] = defaultdict(
        lambda: {"distinct": 0, "warp_instr": 0.0, "samples": 0.0, "stalls": Counter()}
    )
    per_line: dict[str, dict] = defaultdict(
        lambda: {"distinct": 0, "warp_instr": 0.0, "samples": 0.0}
    )
    # instrs may be longer (the function's tail after the kernel's last profiled instruction)
    for p, (_, path, line) in zip(profile, instrs, strict=False):
        if p["executed"] <= 0 and p["samples"] <= 0:
            continue
        f = per_func[func_of(path, line)]
        ln = per_line[f"{Path(path).name}:{line}"]
        for agg in (f, ln):
            agg["distinct"] += p["executed"] > 0
            agg["warp_instr"] += p["executed"]
            agg["samples"] += p["samples"]
        f["stalls"].update(p["stalls"])
    funcs = [
        {"function": k, **{n: v for n, v in d.items() if n != "stalls"},
         "top_stalls": dict(d["stalls"].most_common(3))}
        for k, d in per_func.items()
    ]  # fmt: skip
    funcs.sort(key=lambda d: (-d["distinct"], d["function"]))
    lines = [{"line": k, **d} for k, d in per_line.items()]
    lines.sort(key=lambda d: (-d["samples"], -d["distinct"], d["line"]))
    return {
        "distinct": sum(d["distinct"] for d in funcs),
        "warp_instr": sum(d["warp_instr"] for d in funcs),
        "samples": sum(d["samples"] for d in funcs),
        "functions": funcs,
        "lines": lines,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", type=Path, help="ncu --page source --csv --print-source sass")
    ap.add_argument("listing", type=Path, help="nvdisasm -g -c of the same build")
    ap.add_argument("--src", type=Path, help="source tree (function names for the lines)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", type=Path, help="write the full attribution here")
    args = ap.parse_args(argv)
    kernel, profile = parse_profile(args.profile.read_text())
    funcs = parse_listing(args.listing.read_text())
    name = match_function(profile, funcs)
    res = {"kernel": kernel, "function": name, **attribute(profile, funcs[name], args.src)}
    print(kernel)
    print(f"{res['distinct']} distinct instructions executed, {res['warp_instr']:.0f} warp "
          f"instructions, {res['samples']:.0f} stall samples")  # fmt: skip
    print(f"{'distinct':>8} {'warp_instr':>10} {'samples':>7}  function (top stalls)")
    for d in res["functions"][: args.top]:
        print(f"{d['distinct']:8d} {d['warp_instr']:10.0f} {d['samples']:7.0f}  {d['function']} "
              f"{d['top_stalls']}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
