"""``peagle bench report`` on ``benchmarks/results/released-*-h200.json`` (issue 20's report).

A tiny CPU run of ``peagle bench e2e --projection-shape gpt-oss-20b-tiny`` gives a real file of
the schema (report sections, plots, "not evaluated" goals); crafted full-size files in the same
schema (checked against the tiny run's keys) drive the goal verdicts and the missing-config
listing; the committed H200 file goes through the same code.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from peagle.bench import acceptance_tables as A
from peagle.bench import released as R
from peagle.bench import released_report as RR
from peagle.bench import report
from peagle.cli import main
from peagle.models import released_configs as RC

REPO = Path(__file__).resolve().parent.parent
COMMITTED = REPO / "benchmarks" / "results" / "released-gpt-oss-20b-h200.json"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A real released results file from the CPU (the tiny gpt-oss shape, K=1, C=1)."""
    results = tmp_path_factory.mktemp("results")
    out = results / "released-gpt-oss-20b-tiny-h200.json"
    argv = ["bench", "e2e", "--device", "cpu", "--projection-shape", "gpt-oss-20b-tiny",
            "--synthetic-acceptance", "paper", "--k", "1", "--concurrency", "1",
            "--contexts", "24", "--max-new-tokens", "4", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    return out


# ---------------------------------------------------------------------------------------------
# A crafted full-size file in the schema of peagle.bench.released
# ---------------------------------------------------------------------------------------------


def crafted_row(method: str, k: int, c: int, ctx: int, tps: float, verify_ms: float = 0.1) -> dict:
    k = 0 if method == "none" else k
    al = 1.0 if method == "none" else 1.0 + 0.4 * k
    return {
        "method": method, "k": k, "concurrency": c, "num_requests": max(8, c),
        "max_new_tokens": 256, "output_tokens": 256 * max(8, c), "wall_s": 1.0,
        "tokens_per_s": tps, "tpot_ms": 1e3 * c / tps, "acceptance_length": al,
        "tokens_per_step": al, "steps": 100, "graph_steps": 90, "verify_ms_per_step": None,
        "prefill_steps": 8, "prefill_s": 0.1,
        "decode_tokens_per_s": tps, "per_position_acceptance": [0.8] * k,
        "target_ms_per_step": 5.0 + k, "drafter_ms_per_step": 0.0 if k == 0 else 1.0,
        "overhead_ms_per_step": 0.2, "cuda_graphs": True, "outputs_sha1": "0" * 16,
        "max_num_batched_tokens": 65536, "fused_layers": {"target": True, "drafter": True},
        "breakdown": {"target_pass_ms": 5.0 + k, "verify_ms": verify_ms,
                      "drafter_ms": 0.0 if k == 0 else 1.0,
                      "target_and_verify_ms": 5.0 + k + verify_ms, "host_ms": 0.2},
        "context": ctx, "commit": "abc", "synthetic_acceptance": method != "none",
        "acceptance_table": "paper", "rates": None if k == 0 else [0.78] * k,
        "expected_acceptance_length": al, "routing": R.ROUTING_NOTE,
        "memory": {"kv_gib": 0.1, "allocated_gib": 44.0, "peak_gib": 45.0, "workspace_gib": 3.0},
        "outputs_are_model_text": False,
    }  # fmt: skip


def crafted_floor(method: str, k: int, t_ms: float, floor_ms: float) -> dict:
    return {
        "method": method, "k": k, "concurrency": 1, "context": 1024, "tokens_in_pass": k + 1,
        "t_target_and_verify_ms": t_ms, "copy_gbps": 4000.0, "dense_bytes": 2 * 10**9,
        "expert_bytes": (k + 1) * 10**9, "bytes": (k + 3) * 10**9,
        "experts_touched_per_layer": [min(4 * (k + 1), 32)] * 24, "floor_ms": floor_ms,
        "floor_fraction": round(floor_ms / t_ms, 4), "routing": R.ROUTING_NOTE,
    }  # fmt: skip


def crafted(peagle: dict, eagle3: dict, none: float, floors=((8.0, 2.0), (16.0, 6.0)),
            grid=((1, 1024),)) -> dict:  # fmt: skip
    """A full-size gpt-oss-20b results file: tok/s per K at each (C, ctx) in ``grid`` (scaled by
    C), the floor entries as ``((t_K0, floor_K0), (t_K7, floor_K7))``."""
    configs = {}
    for c, ctx in grid:
        configs[R.config_key("none", 0, c, ctx)] = crafted_row("none", 0, c, ctx, none * c)
        for m, tps in (("peagle", peagle), ("eagle3", eagle3)):
            for k, v in tps.items():
                configs[R.config_key(m, k, c, ctx)] = crafted_row(m, k, c, ctx, v * c)
    table = A.get_table("paper")
    name = "gpt-oss-20b"
    layers = RC.config_fields(name)["num_hidden_layers"]
    return {
        "schema": 1,
        "settings": {"device": "cuda", "dtype": "bfloat16", "max_new_tokens": 256,
                     "greedy": True, "ignore_eos": True, "cuda_graphs": True,
                     "projection_shape": name, "synthetic_acceptance": "paper", "seed": 0,
                     "num_requests": 8},
        "configs": configs,
        "projection": {},
        "synthetic_acceptance": {"enabled": True, **table.to_dict()},
        "routing": R.ROUTING_NOTE,
        "released_shape": {"target": name, "tiny": False, "config": RC.config_fields(name),
                           "experts": "random bf16",
                           "heads": {m: R.head_dict(name, m, False, layers)
                                     for m in ("peagle", "eagle3")},
                           "head_widths": "ASSUMED (SPEC §10)"},
        "memory": {"target_weights_gib": 38.957, "head_weights_gib": {"peagle": 2.9,
                                                                      "eagle3": 2.4},
                   "build_s": 0.3, "allocated_gib": 44.0, "peak_gib": 47.0},
        "gpu": "Crafted GPU", "commit": "abc", "torch": "x", "python": "3",
        "commands": ["peagle bench e2e ..."], "command": "peagle bench e2e ...",
        "floor": {"none,K=0": crafted_floor("none", 0, *floors[0]),
                  "peagle,K=7": crafted_floor("peagle", 7, *floors[1])},
    }  # fmt: skip


GOOD = {1: 150.0, 3: 220.0, 5: 260.0, 7: 300.0, 10: 290.0}  # best K=7
E3 = {1: 150.0, 3: 200.0, 5: 190.0, 7: 180.0, 10: 160.0}  # best K=3


def _write(results: Path, d: dict, name: str = "released-gpt-oss-20b-h200.json") -> Path:
    results.mkdir(parents=True, exist_ok=True)
    p = results / name
    p.write_text(json.dumps(d))
    return p


def _keys(d: dict) -> dict[str, set]:
    row = next(iter(d["configs"].values()))
    floor = next(iter(d["floor"].values()))
    return {"top": set(d), "row": set(row), "breakdown": set(row["breakdown"]),
            "row_memory": set(row["memory"]), "floor": set(floor),
            "released_shape": set(d["released_shape"]),
            "synthetic_acceptance": set(d["synthetic_acceptance"])}  # fmt: skip


def test_crafted_fixture_has_the_schema_of_a_real_run(tiny_run):
    """The CPU run's keys, plus the memory stats only a CUDA run records; the committed H200
    file's keys exactly."""
    real, ours = _keys(json.loads(tiny_run.read_text())), _keys(crafted(GOOD, E3, 100.0))
    cuda_only = {"allocated_gib", "peak_gib", "workspace_gib"}
    for part, keys in ours.items():
        assert real[part] <= keys and keys - real[part] <= cuda_only, part
    if COMMITTED.exists():  # rows measured before the prefill budget / graph-step count /
        committed = _keys(json.loads(COMMITTED.read_text()))  # fused layers lack them
        committed["row"] |= {
            "max_num_batched_tokens",
            "graph_steps",
            "verify_ms_per_step",
            "fused_layers",
        }
        assert ours == committed


# ---------------------------------------------------------------------------------------------
# Goals
# ---------------------------------------------------------------------------------------------


def _goals(d: dict) -> dict[str, RR.Goal]:
    return {g.key: g for g in RR.evaluate_goals(d)}


def test_goal1_met_reports_the_margin():
    g = _goals(crafted(GOOD, E3, 100.0))
    assert g["1a"].status == "met" and g["1a"].measured == pytest.approx(1.5)
    assert g["1a"].distance == pytest.approx(0.2)
    assert "+0.20x" in g["1a"].text and "K=**7**" in g["1a"].text and "K=**3**" in g["1a"].text
    assert g["1b"].status == "met" and g["1b"].measured == 7 and g["1b"].distance == 2
    assert "largest K" not in g["1b"].text  # K=7 is not the edge of the grid (10 is)


def test_goal1_missed_reports_the_shortfall():
    peagle = {1: 150.0, 3: 240.0, 5: 230.0, 7: 220.0, 10: 210.0}  # best K=3: 1.2x EAGLE-3's
    g = _goals(crafted(peagle, E3, 100.0))
    assert g["1a"].status == "missed" and g["1a"].measured == pytest.approx(1.2)
    assert g["1a"].distance == pytest.approx(-0.1)
    assert "missed** by 0.10x" in g["1a"].text and "260.0 tok/s" in g["1a"].text
    assert g["1b"].status == "missed" and g["1b"].distance == -2 and "(-2)" in g["1b"].text
    # at the edge of the K grid the text says the optimum may lie beyond
    edge = _goals(crafted({1: 150.0, 10: 400.0}, E3, 100.0))
    assert edge["1b"].status == "met" and "largest K" in edge["1b"].text


def test_goal1_not_evaluated_for_another_table_or_missing_rows():
    d = crafted(GOOD, E3, 100.0)
    d["synthetic_acceptance"]["name"] = "vllm-pr32628"
    assert {g.status for g in RR.goal1(d)} == {"not evaluated"}
    d = crafted(GOOD, {}, 100.0)
    g = RR.goal1(d)
    assert g[0].status == "not evaluated" and "no EAGLE-3 config" in g[0].text
    # a partial C=1 grid is evaluated but flagged provisional
    g = _goals(crafted({7: 300.0}, {3: 200.0}, 100.0))
    assert g["1a"].status == "met" and "provisional" in g["1a"].text
    assert "peagle,K=1,C=1,ctx=1024" in g["1a"].text


def test_goal2_within_and_beyond_twice_the_floor():
    # K=0: (8.1 - 0.1) / 5 = 1.6x: met; K=7: (16.1 - 0.1) / 4 = 4x: missed by 2x, 8 ms over
    d = crafted(GOOD, E3, 100.0, floors=((8.1, 5.0), (16.1, 4.0)))
    g = _goals(d)
    assert g["2 K=0"].status == "met" and g["2 K=0"].measured == pytest.approx(1.6)
    assert g["2 K=0"].distance == pytest.approx(0.4) and "0.40x to spare" in g["2 K=0"].text
    assert g["2 K=7"].status == "missed" and g["2 K=7"].measured == pytest.approx(4.0)
    assert g["2 K=7"].distance == pytest.approx(-2.0)
    assert "missed** by 2.00x: 8.000 ms over the 8.000 ms" in g["2 K=7"].text
    assert R.ROUTING_NOTE in g["2 K=7"].text  # the MoE caveat next to the number
    # without the config's breakdown the combined time is used, and said to be an upper bound
    del d["configs"]["none,K=0,C=1,ctx=1024"]
    g = _goals(d)
    assert g["2 K=0"].measured == pytest.approx(8.1 / 5.0) and "upper bound" in g["2 K=0"].text
    del d["floor"]["peagle,K=7"]
    assert _goals(d)["2 K=7"].status == "not evaluated"


def test_goals_are_computed_from_the_data_not_fixed():
    a, b = crafted(GOOD, E3, 100.0), crafted({k: v * 0.8 for k, v in GOOD.items()}, E3, 100.0)
    ga, gb = _goals(a)["1a"], _goals(b)["1a"]
    assert gb.measured == pytest.approx(0.8 * ga.measured) and gb.status == "missed"
    qwen = crafted(GOOD, E3, 100.0)
    qwen["released_shape"]["target"] = "qwen3-coder-30b-a3b"
    assert [g.key for g in RR.evaluate_goals(qwen)] == ["2 K=0", "2 K=7"]  # goal 1 is gpt-oss-20b's


# ---------------------------------------------------------------------------------------------
# Sections, missing configs, plots
# ---------------------------------------------------------------------------------------------


def test_missing_configs_are_listed_not_dropped(tmp_path):
    d = crafted(GOOD, E3, 100.0, grid=((1, 1024), (8, 1024)))
    del d["configs"]["eagle3,K=5,C=8,ctx=1024"]
    del d["floor"]["none,K=0"]
    miss = RR.missing_configs(d)
    assert len(miss["configs"]) == 66 - 21 and "eagle3,K=5,C=8,ctx=1024" in miss["configs"]
    assert miss["floor"] == ["none,K=0"]
    _write(tmp_path / "results", d)
    report.generate(tmp_path / "results", tmp_path / "docs")
    md = (tmp_path / "docs" / "results.md").read_text()
    assert "21 of the issue's 66 configs measured; floor 1 of 2." in md
    assert "* C=8, ctx=1024: eagle3 K=5" in md and "* C=64, ctx=1024: all 11" in md
    assert "* C=1, ctx=8192: all 11" in md and "* floor none,K=0" in md
    assert "Not measured yet at this concurrency and context: EAGLE-3 K=5" in md
    assert "**Concurrency 64, context 8192**: not measured yet" in md
    assert "| none | 0 | 1 | 1024 | not measured" not in md and "| none,K=0 | not measured" in md
    # the qwen shape has no file: listed as not measured
    assert "qwen3-coder-30b-a3b: **not measured yet**" in md


def test_report_sections_of_a_full_size_file(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    d = crafted(GOOD, E3, 100.0, floors=((8.1, 5.0), (16.1, 4.0)))
    _write(tmp_path / "results", d)
    written = report.generate(tmp_path / "results", tmp_path / "docs")
    names = {p.name for p in written}
    for png in RR.png_names(d).values():
        assert png in names and (tmp_path / "docs" / png).stat().st_size > 1000
    md = (tmp_path / "docs" / "results.md").read_text()
    sec = md[md.index("### Released shape: gpt-oss-20b") :]
    # (f) labels
    assert "**Acceptance is SYNTHETIC.**" in sec and "rate table `paper`" in sec
    assert A.get_table("paper").source in sec and "not the model's text" in sec
    # (a) per concurrency: best K, ratios; the table rows with the best tok/s in bold
    assert "* best K for P-EAGLE: **K=7**, 300.0 tok/s" in sec
    assert "* best K for EAGLE-3: **K=3**, 200.0 tok/s" in sec
    assert "P-EAGLE best K / EAGLE-3 best K: **1.50x**; P-EAGLE best K / none: **3.00x**" in sec
    assert "| P-EAGLE | 7 | **300.0** | 3.333 |" in sec and "| none | 0 | 100.0 |" in sec
    # (b) breakdown at C=1, ctx 1k, (c) floor with bytes and experts touched
    assert "#### Step breakdown at concurrency 1, context 1024" in sec
    assert "| P-EAGLE | 7 | 3.80 | 12.000 | 1.000 | in drafter | 0.100 | 0.200 |" in sec
    x, frac = f"{16.1 / 4.0:.2f}x", f"{round(4.0 / 16.1, 4):.3f}"
    assert (
        f"| P-EAGLE | 7 | 8 | 1024 | 16.100 | 4.000 | {x} | {frac} | 10.00 (2.00 + 8.00) |" in sec
    )
    assert "32 / 32.0 / 32 of 32" in sec
    # the MoE caveat next to every MoE table and goal-2 number
    for head in ("**Concurrency 1, context 1024**", "One steady decode step", "Measured: the "
                 "target pass", "* Goal 2 (K=0", "* Goal 2 (K=7"):  # fmt: skip
        line = next(ln for ln in sec.splitlines() if ln.startswith(head))
        assert R.ROUTING_NOTE in line, head
    # (d) goals, printed too
    assert "* Goal 1a (P-EAGLE best K / EAGLE-3 best K >= 1.30x): MET." in sec
    assert "* Goal 2 (K=7: target pass <= 2x floor): MISSED." in sec
    out = capsys.readouterr().out
    assert "goal 1a (P-EAGLE best K / EAGLE-3 best K >= 1.30x): MET" in out and "**" not in out
    # published numbers beside ours, labelled, and not in our rows
    assert "#### Published numbers beside ours (other GPU, other engine)" in sec
    assert "| P-EAGLE over EAGLE-3 (up to) | 1.69x |" in sec and sec.count("1.69") == 1
    assert "| P-EAGLE K=7 over no speculation | 1.52x |" in sec and "pull/32887 | 3.00x |" in sec


def test_published_constants_carry_sources_and_stay_out_of_our_numbers():
    assert {p.metric for p in RR.PUBLISHED} == set(RR.our_metrics(crafted(GOOD, E3, 100.0)))
    for p in RR.PUBLISHED:
        assert p.source and p.hardware and p.engine and p.unit in ("x", "AL")
    by = {p.metric: p for p in RR.PUBLISHED}
    assert by["al_peagle_k7"].value == A.PAPER_AL_K7["peagle"] == 3.94
    assert by["al_eagle3_k7"].value == A.PAPER_AL_K7["eagle3"] == 3.03
    assert (by["peagle_best_over_eagle3_best"].value, by["peagle_k7_over_none"].value,
            by["peagle_k7_over_eagle3_best"].value) == (1.69, 1.52, 1.12)  # fmt: skip
    assert (
        "32887" in by["peagle_k7_over_none"].source and "B200" in by["peagle_k7_over_none"].hardware
    )
    ours = RR.our_metrics(crafted(GOOD, E3, 100.0))
    assert ours["peagle_k7_over_none"] == pytest.approx(3.0)
    assert ours["peagle_k7_over_eagle3_best"] == pytest.approx(1.5)
    assert ours["al_peagle_k7"] == pytest.approx(1 + 0.4 * 7)
    assert RR.our_metrics(crafted({}, {}, 100.0))["peagle_k7_over_none"] is None


def test_report_of_a_tiny_cpu_run(tiny_run, tmp_path):
    pytest.importorskip("matplotlib")
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(tiny_run, results)
    written = report.generate(results, tmp_path / "docs")
    d = json.loads(tiny_run.read_text())
    pngs = RR.png_names(d)
    assert pngs["k"] == "released-gpt-oss-20b-tiny-tokens-per-s-vs-k.png"
    for png in (pngs["k"], pngs["breakdown"]):
        assert tmp_path / "docs" / png in written
    # nothing at C=1, ctx 1k to set beside the published numbers: no such plot
    assert tmp_path / "docs" / pngs["published"] not in written
    md = (tmp_path / "docs" / "results.md").read_text()
    assert "### Released shape: gpt-oss-20b (tiny)" in md and "TINY CPU test shape" in md
    # goal 1 is the full shape's; the CPU has no copy bandwidth: no floor, goal 2 not evaluated
    assert md.count("NOT EVALUATED") == 4 and "at full size, not gpt-oss-20b (tiny)" in md
    assert "0 of the issue's 66 configs measured (+3 outside the grid); floor 2 of 2." in md
    assert "gpt-oss-20b: **not measured yet**" in md  # the full-size file is absent
    assert "| P-EAGLE | 1 |" in md and "outputs_are_model_text: false" in md
    assert "#### Step breakdown at concurrency 1, context 24" in md  # no 1k here: the smallest


def test_released_plots_skip_empty_data(tmp_path):
    pytest.importorskip("matplotlib")
    from peagle.bench import plots

    empty = {"configs": {}, "floor": {}}
    assert plots.released_tokens_per_s_vs_k(empty, tmp_path / "a.png") is None
    assert plots.released_step_breakdown(empty, tmp_path / "b.png") is None
    ours = RR.our_metrics(empty)
    assert plots.released_vs_published(empty, ours, RR.PUBLISHED, tmp_path / "c.png") is None
    assert not list(tmp_path.iterdir())


def test_committed_h200_file_through_the_report(tmp_path):
    """The committed partial H200 run: every config counted (measured + missing = the grid), and
    the goal verdicts recomputed here from its raw rows."""
    if not COMMITTED.exists():
        pytest.skip("no committed released results file")
    d = json.loads(COMMITTED.read_text())
    miss = RR.missing_configs(d)
    exp = RR.expected_keys()
    assert len(exp) == 66 and len(miss["configs"]) + len(set(d["configs"]) & set(exp)) == 66
    rows = [r for r in d["configs"].values() if r["concurrency"] == 1 and r["context"] == 1024]
    best = {m: max((r for r in rows if r["method"] == m), key=lambda r: r["tokens_per_s"])
            for m in ("peagle", "eagle3")}  # fmt: skip
    ratio = best["peagle"]["tokens_per_s"] / best["eagle3"]["tokens_per_s"]
    g = _goals(d)
    assert g["1a"].measured == pytest.approx(ratio) and g["1b"].measured == best["peagle"]["k"]
    assert g["1a"].status == ("met" if ratio >= 1.3 else "missed")
    f = d["floor"]["none,K=0"]
    x = (f["t_target_and_verify_ms"] - d["configs"]["none,K=0,C=1,ctx=1024"]["breakdown"][
        "verify_ms"]) / f["floor_ms"]  # fmt: skip
    assert g["2 K=0"].measured == pytest.approx(x) and g["2 K=0"].status == (
        "met" if x <= 2 else "missed"
    )
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(COMMITTED, results)
    report.generate(results, tmp_path / "docs")
    md = (tmp_path / "docs" / "results.md").read_text()
    for key in miss["configs"][:3]:
        m, k, c, ctx = key.split(",")
        assert f"{c}, {ctx}" in md  # each missing (C, ctx) group is listed
    assert copy.deepcopy(d) == json.loads(COMMITTED.read_text())  # the report never writes it


def test_profile_section_is_computed_from_the_profile_file(tmp_path):
    """The target-pass profile (tools/profile_target_pass.py) renders from its numbers; no file,
    no section."""
    prof = json.loads(
        (REPO / "benchmarks" / "results" / "profile-target-pass-gpt-oss-20b-h200.json").read_text()
    )
    lines = "\n".join(RR.profile_table(prof))
    one = prof["passes"]["1"]
    assert f"| 1 | {one['graph_ms']:.3f} | {one['floor_ms']:.3f} | {one['x_floor']:.2f}x |" in lines
    assert f"{RR.expert_gemm_us(one) / 1e3:.3f} ({one['expert_floor_ms']:.3f})" in lines
    assert RR.expert_gemm_us(one) > 0
    crafted = copy.deepcopy(prof)
    crafted["passes"]["1"]["graph_ms"] = 123.456
    crafted["passes"]["1"].pop("compiled_graph_ms")
    crafted["passes"]["1"]["compile_error"] = "RuntimeError: x"
    out = "\n".join(RR.profile_table(crafted))
    assert "| 1 | 123.456 |" in out and "| failed |" in out
    assert RR.profile_table(None) == []
    assert RR.load_profile(tmp_path, "gpt-oss-20b") is None
    shutil.copy(
        REPO / "benchmarks" / "results" / "profile-target-pass-gpt-oss-20b-h200.json", tmp_path
    )
    assert RR.load_profile(tmp_path, "gpt-oss-20b") == prof
