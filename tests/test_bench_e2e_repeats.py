"""docs/results.md's run-to-run section (peagle.bench.e2e_repeats): medians, spread, the goals'
ratios per run and on the medians; repeats with other settings are not mixed in."""

from __future__ import annotations

import json

from peagle.bench import e2e_repeats

SETTINGS = {"device": "cuda", "num_prompts": 64}


def _run(tps: dict[tuple[str, int], float], c: int = 1, settings=SETTINGS) -> dict:
    configs = {
        f"{m},K={k},C={c}": {"method": m, "k": k, "concurrency": c, "tokens_per_s": t}
        for (m, k), t in tps.items()
    }
    return {"settings": dict(settings), "commit": "abc", "configs": configs}


RUNS = [
    {("none", 0): 100.0, ("peagle", 3): 150.0, ("peagle", 10): 210.0, ("eagle3", 3): 160.0},
    {("none", 0): 120.0, ("peagle", 3): 240.0, ("peagle", 10): 200.0, ("eagle3", 3): 150.0},
    {("none", 0): 110.0, ("peagle", 3): 180.0, ("peagle", 10): 190.0, ("eagle3", 3): 170.0},
]


def test_median_rows_take_each_configs_median():
    rows = {(r["method"], r["k"]): r["tokens_per_s"] for r in e2e_repeats.median_rows(
        [_run(t) for t in RUNS])}  # fmt: skip
    assert rows == {("none", 0): 110.0, ("peagle", 3): 180.0, ("peagle", 10): 200.0,
                    ("eagle3", 3): 160.0}  # fmt: skip


def test_section_reports_runs_medians_spread_and_ratios():
    main, *reps = [_run(t) for t in RUNS]
    lines = e2e_repeats.section(main, reps)
    text = "\n".join(lines)
    assert "3 runs of the same grid" in text
    # K sorted numerically within a method: K=3 before K=10
    rows = [ln for ln in lines if ln.startswith("| peagle |")]
    assert rows[0].startswith("| peagle | 3 |") and rows[1].startswith("| peagle | 10 |")
    assert rows[0] == "| peagle | 3 | 150 | 240 | 180 | 180 | 50 % |"
    ratio = next(ln for ln in lines if ln.startswith("| P-EAGLE / EAGLE-3 |"))
    # per run: 210/160, 240/150, 190/170; medians: 200/160
    assert ratio == "| P-EAGLE / EAGLE-3 | 1.31x | 1.60x | 1.12x | 1.25x |"
    best = next(ln for ln in lines if ln.startswith("| P-EAGLE best |"))
    assert best.endswith("| K=10 200, 1.82x none |")


def test_no_repeats_no_section_and_other_settings_are_skipped(tmp_path):
    main = _run(RUNS[0])
    assert e2e_repeats.section(main, []) == []
    (tmp_path / "e2e-h200-repeat1.json").write_text(json.dumps(_run(RUNS[1])))
    other = dict(SETTINGS, num_prompts=8)
    (tmp_path / "e2e-h200-repeat2.json").write_text(json.dumps(_run(RUNS[2], settings=other)))
    found = e2e_repeats.find(tmp_path, main)
    assert [d["configs"]["none,K=0,C=1"]["tokens_per_s"] for d in found] == [120.0]
