"""Matplotlib PNGs for docs/: per-kernel % of the copy ceiling, e2e tokens/s vs K, speedup vs
concurrency. Each function returns the written path, or None when there is nothing to plot or
matplotlib is missing. Projected rows are drawn dashed and say "projection" in their label."""

from __future__ import annotations

import textwrap
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


# ---------------------------------------------------------------------------------------------
# Released shapes (peagle.bench.released_report): random weights, synthetic acceptance
# ---------------------------------------------------------------------------------------------

RELEASED_DPI = 100
BREAKDOWN_PARTS = (  # (breakdown key, label, color)
    ("target_pass_ms", "target pass", "#4c72b0"),
    ("verify_ms", "verify", "#dd8452"),
    ("prep_ms", "prep", "#8172b3"),
    ("drafter_ms", "drafter", "#c44e52"),
    ("host_ms", "host", "#937860"),
)


def _released_title(data: dict, what: str) -> str:
    rs = data.get("released_shape") or {}
    table = (data.get("synthetic_acceptance") or {}).get("name", "?")
    tiny = " (tiny)" if rs.get("tiny") else ""
    return (
        f"{rs.get('target', '?')}{tiny}: {what}\n{data.get('gpu', '?')}, random weights, "
        f"SYNTHETIC acceptance (table '{table}'); outputs are not the model's text"
    )


def released_tokens_per_s_vs_k(data: dict, out: Path) -> Path | None:
    """One panel per (context, concurrency): tokens/s vs K per method, no speculation as a
    horizontal line; a context appears when it has measured rows."""
    plt = _pyplot()
    rows = list(data.get("configs", {}).values())
    if plt is None or not rows:
        return None
    contexts = sorted({r["context"] for r in rows})
    concs = sorted({r["concurrency"] for r in rows})
    fig, axes = plt.subplots(
        len(contexts),
        len(concs),
        figsize=(3.8 * len(concs), 3.0 * len(contexts) + 0.6),
        squeeze=False,
    )
    for i, ctx in enumerate(contexts):
        for j, c in enumerate(concs):
            ax = axes[i][j]
            rs = [r for r in rows if r["context"] == ctx and r["concurrency"] == c]
            ax.set_title(f"concurrency {c}, context {ctx}", fontsize=8)
            if not rs:
                ax.text(
                    0.5,
                    0.5,
                    "not measured yet",
                    ha="center",
                    va="center",
                    transform=ax.transAxes,
                    fontsize=8,
                    color="gray",
                )
                ax.set_xticks([])
                ax.set_yticks([])
                continue
            for m in ("peagle", "eagle3"):
                pts = sorted((r["k"], r["tokens_per_s"]) for r in rs if r["method"] == m)
                if pts:
                    ax.plot(
                        *zip(*pts, strict=True), "-", marker="o", color=COLORS[m], label=LABELS[m]
                    )
            for r in rs:
                if r["method"] == "none":
                    ax.axhline(
                        r["tokens_per_s"], color=COLORS["none"], ls=":", label=LABELS["none"]
                    )
            ks = sorted({r["k"] for r in rs if r["method"] != "none"})
            if ks:
                ax.set_xticks(ks)
            else:
                ax.text(
                    0.5,
                    0.3,
                    "speculative configs\nnot measured yet",
                    ha="center",
                    va="center",
                    transform=ax.transAxes,
                    fontsize=8,
                    color="gray",
                )
                ax.set_xticks([])
            ax.set_xlabel("K (drafts per step)", fontsize=8)
            ax.set_ylabel("output tokens/s", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle(_released_title(data, "tokens/s vs K"), fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=RELEASED_DPI)
    plt.close(fig)
    return out


def released_step_breakdown(
    data: dict, out: Path, concurrency: int = 1, context: int = 1024
) -> Path | None:
    """Stacked bars per (method, K) at one concurrency and context: the ``breakdown`` phases
    (prep only where the file times it separately; otherwise it is inside the drafter)."""
    plt = _pyplot()
    order = {"none": 0, "peagle": 1, "eagle3": 2}
    rows = sorted(
        (
            r
            for r in data.get("configs", {}).values()
            if r["concurrency"] == concurrency and r["context"] == context and "breakdown" in r
        ),
        key=lambda r: (order.get(r["method"], 3), r["k"]),
    )
    if plt is None or not rows:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(rows) + 2), 4.2))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for key, label, color in BREAKDOWN_PARTS:
        vals = [r["breakdown"].get(key) or 0.0 for r in rows]
        if not any(vals):
            continue
        ax.bar(x, vals, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, r in enumerate(rows):
        ax.text(
            i, bottom[i], f"AL {r['acceptance_length']:.2f}", ha="center", va="bottom", fontsize=6
        )
    ax.set_xticks(
        list(x),
        [("none" if r["method"] == "none" else f"{LABELS[r['method']]}\nK={r['k']}") for r in rows],
        fontsize=7,
    )
    ax.set_ylabel("ms per decode step (phases timed one by one)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(
        _released_title(data, f"step breakdown, concurrency {concurrency}, context {context}"),
        fontsize=8,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=RELEASED_DPI)
    plt.close(fig)
    return out


def released_vs_published(data: dict, ours: dict, published, out: Path) -> Path | None:
    """Ours (this file, H200, peagle, synthetic acceptance) beside the published numbers
    (``published``: :data:`peagle.bench.released_report.PUBLISHED`; hatched grey, labelled
    other GPU, other engine): speed ratios in one panel, acceptance lengths in the other."""
    plt = _pyplot()
    if plt is None or not published or all(ours.get(p.metric) is None for p in published):
        return None
    panels = [("x", "speed ratio"), ("AL", "acceptance length (tokens per target step)")]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    for ax, (unit, ylabel) in zip(axes, panels, strict=True):
        ps = [p for p in published if p.unit == unit]
        for i, p in enumerate(ps):
            o = ours.get(p.metric)
            ax.bar(
                i - 0.2,
                p.value,
                0.4,
                color="#bbbbbb",
                hatch="//",
                edgecolor="#555555",
                label="published: other GPU, other engine" if i == 0 else None,
            )
            ax.text(i - 0.2, p.value, f"{p.value:.2f}", ha="center", va="bottom", fontsize=7)
            if o is None:
                ax.text(i + 0.2, 0.05, "not\nmeasured", ha="center", va="bottom", fontsize=6)
                continue
            ax.bar(
                i + 0.2,
                o,
                0.4,
                color=COLORS["peagle"],
                label="ours: H200, peagle, random weights, synthetic acceptance"
                if i == 0
                else None,
            )
            ax.text(i + 0.2, o, f"{o:.2f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(
            range(len(ps)),
            [textwrap.fill(p.claim, 30) + f"\n{p.model.split(',')[0]}; {p.hardware}" for p in ps],
            fontsize=6,
        )
        if unit == "x":
            ax.axhline(1.0, color=COLORS["none"], ls=":", lw=0.8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
    fig.suptitle(_released_title(data, "ours (C=1, ctx 1024) beside published numbers"), fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=RELEASED_DPI)
    plt.close(fig)
    return out
