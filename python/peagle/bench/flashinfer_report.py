"""docs/results.md sections that put peagle next to FlashInfer measured in the same run (issue 21).

``verify_section``: from ``verify-h200.json`` (``peagle bench ops verify``): FlashInfer's sampling
path from bf16 logits for every random case. Its cost for one verify step is the chain
(temperature, softmax, ``chain_speculative_sampling``) plus, where top-k/top-p is on, the bonus
row's ``top_k_top_p_sampling_from_logits``; each part's chi-square p-value is shown (p < 1e-3 is
a failed distribution check, marked).

``attention_section``: from ``attention-h200.json`` (or a separate
``attention-flashinfer-h200.json``; ``peagle bench ops attention`` with FlashInfer importable): the
best backend per case, every backend's error, and, where the A/B file
of the same reservation holds peagle's default path measured in another call, that column too
(labelled: not the same run).
"""

from __future__ import annotations

from peagle.bench.rows import case_of, mode_of

ALPHA = 1e-3


def _by_case(d: dict) -> dict[str, dict[str, dict]]:
    by: dict[str, dict[str, dict]] = {}
    for r in d["rows"]:
        if mode_of(r) == "graph":
            by.setdefault(case_of(r), {})[r["impl"]] = r
    return by


def _chi(r: dict) -> str:
    p = r.get("chi2_p")
    if p is None:
        return "—"
    return f"{p:.3g}" + (" **fails**" if p < ALPHA else "")


def verify_section(d: dict) -> list[str]:
    """Markdown rows: peagle vs FlashInfer's sampling path, random cases only; [] if absent."""
    fi = d.get("flashinfer") or {}
    by = {c: i for c, i in _by_case(d).items() if "flashinfer-chain" in i and "peagle" in i}
    if not by:
        return []
    out = [f"vs FlashInfer {fi.get('version', '?')} sampling from logits (same run; chain = "
           "temperature + softmax + `chain_speculative_sampling` with one-hot draft "
           "probabilities prepared outside the timed region; bonus = "
           "`top_k_top_p_sampling_from_logits` on the bonus row; chi-square p of each output "
           "against the target distribution):", "",
           "| case | peagle µs | peagle chi² p | FlashInfer chain µs | chain chi² p | "
           "FlashInfer bonus µs | bonus chi² p | FlashInfer total µs | speedup |",
           "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for case, impls in by.items():
        p, chain = impls["peagle"], impls["flashinfer-chain"]
        bonus = impls.get("flashinfer-bonus-tktp")
        total = chain["median_us"] + (bonus["median_us"] if bonus else 0.0)
        b_us, b_chi = (f"{bonus['median_us']:.1f}", _chi(bonus)) if bonus else ("—", "—")
        out.append(
            f"| {case} | {p['median_us']:.1f} | {_chi(p)} | {chain['median_us']:.1f} | "
            f"{_chi(chain)} | {b_us} | {b_chi} | {total:.1f} | {total / p['median_us']:.1f}x |"
        )
    for case, errs in (fi.get("errors") or {}).items():
        for impl, e in errs.items():
            out.append(f"| {case} | — | — | {impl}: {e} | | | | | |")
    return out + [""]


def _errors_by_backend(fi: dict) -> dict[str, set[str]]:
    seen: dict[str, set[str]] = {}
    for errs in (fi.get("errors") or {}).values():
        for impl, e in errs.items():
            seen.setdefault(impl, set()).add(e)
    return seen


def attention_section(d: dict, ab: dict | None = None) -> list[str]:
    """Markdown: the best FlashInfer backend per case vs peagle in the same run; [] if absent."""
    fi = d.get("flashinfer") or {}
    by = _by_case(d)
    default_us = {}
    if ab:  # peagle's default path from the same reservation's A/B file ("old" side)
        default_us = {r["case"]: min(r["old_us"]) for r in ab.get("rows", [])
                      if r.get("family") == "attention"}  # fmt: skip
    rows, ahead, ahead_default = [], 0, 0
    for case, impls in by.items():
        peers = {k: r for k, r in impls.items() if k.startswith("flashinfer")}
        if "peagle" not in impls or not peers:
            continue
        best = min(peers, key=lambda k: peers[k]["median_us"])
        b_us, p_us = peers[best]["median_us"], impls["peagle"]["median_us"]
        ahead += p_us < b_us
        name = best[len("flashinfer-") :]
        row = f"| {case} | {name} | {b_us:.1f} | {p_us:.1f} | {b_us / p_us:.2f}x |"
        if default_us:  # the same-run rows are another path: peagle's default beside them
            d_us = default_us.get(case)
            ahead_default += d_us is not None and d_us < b_us
            row += f" {d_us:.1f} ({b_us / d_us:.2f}x) |" if d_us else " — |"
        rows.append(row)
    if not rows:
        return []
    tally = f"peagle ahead of the best backend at {ahead} of {len(rows)} cases in the same run"
    if default_us:
        tally += f"; its default path (A/B file) at {ahead_default} of {len(default_us)}"
    out = [
        f"vs FlashInfer {fi.get('version', '?')}, the fastest backend per case that ran "
        "(same run; conditions in the line above):",
        "",
        "| case | best FlashInfer backend | its µs | peagle µs (same run) | speedup |"
        + (" peagle default µs (A/B file, other call) |" if default_us else ""),
        "|---|---|---|---|---|" + ("---|" if default_us else ""),
        *rows,
        "",
        tally + ".",
        "",
    ]
    errs = _errors_by_backend(fi)
    if errs:
        out += ["Backends that did not run (error, every case unless noted):", ""]
        out += [f"* `{impl}`: " + "; ".join(sorted(e)) for impl, e in sorted(errs.items())]
        out += [""]
    return out
