"""Best K per method and break-even tables from e2e results (``peagle tune``).

Rows are the measured configs of an e2e results file (``configs``) or the projected ones
(:func:`peagle.bench.projection.project` over ``projection``; always labelled). For one
concurrency (and one context, where the rows record several, as the released-shape files do):
each speculative method's K with the most tokens/s, its speedup over no speculation,
and per K the tokens/s of every method with its speedup; a K where a method's speedup is below 1
is where speculation stops paying.
"""

from __future__ import annotations

import json
from pathlib import Path

from peagle.errors import UserError

SPEC_METHODS = ("peagle", "eagle3")
LABELS = {"peagle": "P-EAGLE", "eagle3": "EAGLE-3", "none": "no speculation"}


def load(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"tune --results {p}", "no results file", "run `peagle bench e2e` first")
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"tune --results {p}", f"not valid JSON ({e})") from e


def pair_acceptance_lengths() -> dict:
    try:
        from peagle import default_models

        return default_models.info().get("acceptance_length", {})
    except (FileNotFoundError, OSError, ValueError):
        return {}


def measured_rows(data: dict) -> list[dict]:
    return list(data.get("configs", {}).values())


def check_e2e(data: dict, path: str | Path) -> None:
    """A ``peagle bench e2e`` results file has ``configs``; anything else gets a one-line error."""
    if not isinstance(data, dict) or not isinstance(data.get("configs"), dict):
        raise UserError(f"tune --results {path}", "not an e2e results file (no `configs`)",
                        "give the JSON `peagle bench e2e --out` wrote")  # fmt: skip


def projected_rows(data: dict) -> list[dict]:
    from peagle.bench.projection import project

    timings = data.get("projection", {})
    return project(timings, data.get("configs", {}), pair_acceptance_lengths()) if timings else []


def concurrencies(rows: list[dict]) -> list[int]:
    return sorted({r["concurrency"] for r in rows})


def contexts(rows: list[dict], concurrency: int) -> list[int | None]:
    """The contexts (prompt tokens) the rows of one concurrency record; [None] where none do."""
    found = {r.get("context") for r in rows if r["concurrency"] == concurrency}
    return sorted(found, key=lambda c: (c is None, c or 0)) or [None]


def analyse(rows: list[dict], concurrency: int, context: int | None = None) -> dict:
    """``{"concurrency", "context", "none_tokens_per_s", "best": {method: {"k", "tokens_per_s",
    "speedup"}}, "table": [{"k", method: {"tokens_per_s", "speedup", "pays"}}],
    "peagle_over_eagle3"}`` over ``rows`` of one concurrency and, where given, one context
    (speedups None without a ``none`` row)."""
    rows = [r for r in rows if r["concurrency"] == concurrency]
    if context is not None:
        rows = [r for r in rows if r.get("context") == context]
    elif len({r.get("context") for r in rows}) > 1:
        raise ValueError(f"rows of concurrency {concurrency} mix contexts: pass context=")
    none = [r["tokens_per_s"] for r in rows if r["method"] == "none"]
    base = none[0] if none else None
    speedup = lambda tps: None if base is None else round(tps / base, 4)
    best, table = {}, {}
    for r in rows:
        m = r["method"]
        if m not in SPEC_METHODS:
            continue
        cell = {"tokens_per_s": r["tokens_per_s"], "speedup": speedup(r["tokens_per_s"])}
        cell["pays"] = None if base is None else r["tokens_per_s"] > base
        table.setdefault(r["k"], {"k": r["k"]})[m] = cell
        if m not in best or r["tokens_per_s"] > best[m]["tokens_per_s"]:
            best[m] = {"k": r["k"], **cell}
    ratio = None
    if "peagle" in best and "eagle3" in best:
        ratio = round(best["peagle"]["tokens_per_s"] / best["eagle3"]["tokens_per_s"], 4)
    return {
        "concurrency": concurrency,
        "context": context,
        "none_tokens_per_s": base,
        "best": best,
        "table": [table[k] for k in sorted(table)],
        "peagle_over_eagle3": ratio,
    }


def format_analysis(a: dict, label: str = "measured") -> list[str]:
    c = a["concurrency"]
    proj = label != "measured"
    tag = " [PROJECTION]" if proj else ""
    ctx = f", context {a['context']}" if a.get("context") is not None else ""
    lines = [f"== concurrency {c}{ctx} ({label}){tag}"]
    if a["none_tokens_per_s"] is not None:
        lines.append(f"   no speculation: {a['none_tokens_per_s']:.1f} tok/s")
    for m in SPEC_METHODS:
        b = a["best"].get(m)
        if b:
            sp = f", {b['speedup']:.2f}x over none" if b["speedup"] is not None else ""
            label = LABELS[m] + ":"
            lines.append(f"   best K for {label:9s} K={b['k']:<3d} {b['tokens_per_s']:.1f} "
                         f"tok/s{sp}")  # fmt: skip
    if a["peagle_over_eagle3"] is not None:
        lines.append(f"   P-EAGLE / EAGLE-3 at their best K: {a['peagle_over_eagle3']:.2f}x")
    methods = [m for m in SPEC_METHODS if any(m in row for row in a["table"])]
    head = "   K   " + "".join(f"{LABELS[m] + ' tok/s':>16s}{'vs none':>9s}" for m in methods)
    lines += ["   break-even table (x = slower than no speculation):", head]
    for row in a["table"]:
        cells = []
        for m in methods:
            cell = row.get(m)
            if cell is None:
                cells.append(f"{'-':>16s}{'':>9s}")
                continue
            sp = "-" if cell["speedup"] is None else f"{cell['speedup']:.2f}x"
            mark = " x" if cell["pays"] is False else "  "
            cells.append(f"{cell['tokens_per_s']:>16.1f}{sp:>7s}{mark}")
        lines.append(f"   {row['k']:<4d}" + "".join(cells))
    return lines


def projection_label(data: dict) -> str:
    """Label of the projected rows, from the shape recorded in the results file."""
    shape = data.get("projection_shape") or {}
    if shape.get("hidden_size", 2048) == 2048 and shape.get("num_layers", 16) == 16:
        return "projection: ~1B random-weight target"
    return (
        f"projection: random-weight target, hidden {shape.get('hidden_size')}, "
        f"{shape.get('num_layers')} layers"
    )


def print_tables(data: dict, concurrency: int | None = None, projection: bool = True) -> None:
    for label, rows in (("measured", measured_rows(data)),
                        (projection_label(data), projected_rows(data)
                         if projection else [])):  # fmt: skip
        cs = concurrencies(rows) if concurrency is None else [concurrency]
        for c in cs:
            for ctx in contexts(rows, c):
                a = analyse(rows, c, ctx)
                if a["best"] or a["none_tokens_per_s"] is not None:
                    print("\n".join(format_analysis(a, label)))
