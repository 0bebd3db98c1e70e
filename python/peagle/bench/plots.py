"""Matplotlib PNGs for docs/: per-kernel % of the copy ceiling, e2e tokens/s vs K, speedup vs
concurrency. Each function returns the written path, or None when there is nothing to plot or
matplotlib is missing. Projected rows are drawn dashed and say "projection" in their label."""

from __future__ import annotations

from pathlib import Path

COLORS = {"peagle": "#c44e52", "eagle3": "#4c72b0", "none": "#555555"}
LABELS = {"peagle": "P-EAGLE", "eagle3": "EAGLE-3", "none": "no speculation"}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def kernels_pct_of_ceiling(families: dict[str, dict], out: Path) -> Path | None:
    """Horizontal bars: peagle's CUDA-graph GB/s per case as % of the measured copy ceiling."""
    from peagle.bench.rows import case_of, mode_of

    plt = _pyplot()
    if plt is None:
        return None
    labels, values, colors = [], [], []
    palette = {"prep": "#4c72b0", "verify": "#dd8452", "attention": "#55a868", "kv": "#8172b3"}
    for fam, d in families.items():
        for r in d["rows"]:
            if r["impl"] != "peagle" or mode_of(r) != "graph" or not r.get("gbps"):
                continue
            labels.append(f"{fam}: {case_of(r)}")
            values.append(100 * r["gbps"] / d["copy_ceiling_gbps"])
            colors.append(palette.get(fam, "gray"))
    if not values:
        return None
    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.12 * len(values) + 1.5)))
    ax.barh(range(len(values)), values, color=colors)
    ax.set_yticks(range(len(values)), labels, fontsize=5)
    ax.invert_yaxis()
    ax.set_xlabel("% of measured copy bandwidth (H200, CUDA graph)")
    ax.set_title("peagle kernels: achieved bandwidth vs the copy ceiling")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out


def _sets(data: dict):
    from peagle.bench.tune import measured_rows, projected_rows

    sets = [("measured", measured_rows(data), "-")]
    proj = projected_rows(data)
    if proj:
        sets.append(("projection, ~1B random-weight target", proj, "--"))
    return [s for s in sets if s[1]]


def tokens_per_s_vs_k(data: dict, out: Path) -> Path | None:
    """One panel per (row set, concurrency): tokens/s vs K per speculative method, no
    speculation as a horizontal line."""
    plt = _pyplot()
    sets = _sets(data)
    if plt is None or not sets:
        return None
    # One row of panels per row set (measured, projection), one column per concurrency.
    grid = [(rows, ls, sorted({r["concurrency"] for r in rows})) for _, rows, ls in sets]
    cols = max(len(cs) for _, _, cs in grid)
    fig, axes = plt.subplots(len(grid), cols, figsize=(4.2 * cols, 3.4 * len(grid)), squeeze=False)
    panels = []
    for i, (rows, ls, cs) in enumerate(grid):
        panels += [(axes[i][j], rows, ls, c) for j, c in enumerate(cs)]
        for j in range(len(cs), cols):
            axes[i][j].set_visible(False)
    for ax, rows, ls, c in panels:
        rows = [r for r in rows if r["concurrency"] == c]
        for m in ("peagle", "eagle3"):
            pts = sorted((r["k"], r["tokens_per_s"]) for r in rows if r["method"] == m)
            if pts:
                ax.plot(*zip(*pts, strict=True), ls, marker="o", color=COLORS[m], label=LABELS[m])
        for r in rows:
            if r["method"] == "none":
                ax.axhline(r["tokens_per_s"], color=COLORS["none"], ls=":", label=LABELS["none"])
        ax.set_title(f"concurrency {c}" + (" (PROJECTION)" if ls == "--" else ""), fontsize=9)
        ax.set_xlabel("K (drafts per step)")
        ax.set_xticks(sorted({r["k"] for r in rows if r["method"] != "none"}))
        ax.set_ylabel("output tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_title(data, "tokens/s vs K"), fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def speedup_vs_concurrency(data: dict, out: Path) -> Path | None:
    """Each method's speedup over no speculation at its best K, per concurrency (solid:
    measured, dashed: projection)."""
    from peagle.bench.tune import analyse

    plt = _pyplot()
    sets = _sets(data)
    if plt is None or not sets:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    drawn, all_c = False, set()
    for label, rows, ls in sets:
        cs = sorted({r["concurrency"] for r in rows})
        for m in ("peagle", "eagle3"):
            pts = []
            for c in cs:
                b = analyse(rows, c)["best"].get(m)
                if b and b["speedup"] is not None:
                    pts.append((c, b["speedup"]))
            if pts:
                tag = "" if label == "measured" else " (projection)"
                ax.plot(*zip(*pts, strict=True), ls, marker="o", color=COLORS[m],
                        label=f"{LABELS[m]}, best K{tag}")  # fmt: skip
                drawn = True
                all_c.update(c for c, _ in pts)
    if not drawn:
        plt.close(fig)
        return None
    ax.axhline(1.0, color=COLORS["none"], ls=":", label="no speculation")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(all_c), [str(c) for c in sorted(all_c)])
    ax.minorticks_off()
    ax.set_xlabel("concurrency (requests decoded together)")
    ax.set_ylabel("speedup over no speculation")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(_title(data, "speedup vs concurrency"), fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def _title(data: dict, what: str) -> str:
    s = data.get("settings", {})
    return (
        f"{what}\ndefault pair, {data.get('gpu', '?')}, greedy, {s.get('max_new_tokens', '?')} "
        f"new tokens, {s.get('num_prompts', '?')} held-out prompts"
    )
