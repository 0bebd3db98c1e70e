"""``peagle tune`` tables, ``peagle bench ops`` without CUDA, the results JSON writer, the
report's timing-mode parsing, and the plots (synthetic results, CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import user_error
from conftest import requires_cuda

from peagle.bench import report, timing, tune
from peagle.cli import build_parser, main


def row(method, k, c, tps, al=2.0, overhead=0.5):
    return {"method": method, "k": k, "concurrency": c, "tokens_per_s": tps,
            "acceptance_length": al, "overhead_ms_per_step": overhead}  # fmt: skip


def synthetic_e2e(with_projection: bool = True) -> dict:
    configs = {}
    for c, scale in ((1, 1.0), (16, 10.0)):
        configs[f"none,K=0,C={c}"] = row("none", 0, c, 100 * scale, 1.0)
        for k, p, e in ((1, 120, 130), (3, 150, 110), (5, 140, 95), (7, 90, 80)):
            configs[f"peagle,K={k},C={c}"] = row("peagle", k, c, p * scale, 1.5 + k / 10)
            configs[f"eagle3,K={k},C={c}"] = row("eagle3", k, c, e * scale, 1.6 + k / 10)
    data = {"gpu": "Synthetic GPU", "commit": "abc", "command": "peagle bench e2e", "torch": "x",
            "settings": {"max_new_tokens": 128, "num_prompts": 64, "dtype": "bfloat16",
                         "cuda_graphs": True},
            "configs": configs, "projection": {}}  # fmt: skip
    if with_projection:
        for k in (1, 3, 5, 7):
            for m, draft in (("peagle", 1.0), ("eagle3", 0.6 * k)):
                data["projection"][f"{m},K={k},C=1"] = {
                    "method": m, "k": k, "concurrency": 1, "t_verify_ms": 10.0 + k,
                    "t_draft_ms": draft, "projection": True}  # fmt: skip
        data["projection"]["none,K=0,C=1"] = {"method": "none", "k": 0, "concurrency": 1,
                                              "t_verify_ms": 9.5, "t_draft_ms": 0.0,
                                              "projection": True}  # fmt: skip
    return data


# ---------------------------------------------------------------------------------------------
# tune
# ---------------------------------------------------------------------------------------------


def test_tune_best_k_and_break_even():
    a = tune.analyse(tune.measured_rows(synthetic_e2e()), 1)
    assert a["none_tokens_per_s"] == 100
    assert a["best"]["peagle"] == {"k": 3, "tokens_per_s": 150, "speedup": 1.5, "pays": True}
    assert a["best"]["eagle3"]["k"] == 1 and a["best"]["eagle3"]["speedup"] == 1.3
    assert a["peagle_over_eagle3"] == pytest.approx(150 / 130, abs=1e-3)
    by_k = {r["k"]: r for r in a["table"]}
    assert [r["k"] for r in a["table"]] == [1, 3, 5, 7]
    assert by_k[7]["peagle"]["pays"] is False and by_k[5]["peagle"]["pays"] is True
    assert by_k[5]["eagle3"]["pays"] is False and by_k[3]["eagle3"]["pays"] is True
    assert by_k[7]["eagle3"]["speedup"] == 0.8
    text = "\n".join(tune.format_analysis(a))
    assert "K=3" in text and "1.50x over none" in text
    lines = {ln.split()[0]: ln for ln in text.splitlines() if ln.strip()[:1].isdigit()}
    assert lines["7"].count(" x") == 2 and lines["1"].count(" x") == 0


def test_tune_without_a_none_row_has_no_speedups():
    rows = [r for r in tune.measured_rows(synthetic_e2e()) if r["method"] != "none"]
    a = tune.analyse(rows, 16)
    assert a["none_tokens_per_s"] is None and a["best"]["peagle"]["speedup"] is None
    assert a["best"]["peagle"]["k"] == 3 and a["best"]["peagle"]["tokens_per_s"] == 1500


def test_tune_cli_measured_and_projected(tmp_path, capsys):
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(synthetic_e2e()))
    assert main(["tune", "--results", str(path), "--concurrency", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    measured = [a for a in out if not a["projection"]]
    projected = [a for a in out if a["projection"]]
    assert len(measured) == 1 and measured[0]["best"]["peagle"]["k"] == 3
    assert len(projected) == 1 and "projection" in projected[0]["source"]
    # Projection: AL from the measured rows, overhead 0.5 ms (measured), same formula.
    p3 = {r["k"]: r for r in projected[0]["table"]}[3]["peagle"]
    assert p3["tokens_per_s"] == pytest.approx(1 * 1.8 / ((13.0 + 1.0 + 0.5) / 1e3), rel=1e-3)
    assert main(["tune", "--results", str(path), "--concurrency", "1"]) == 0
    text = capsys.readouterr().out
    assert "[PROJECTION]" in text and "break-even" in text
    user_error(capsys, ["tune", "--results", str(path), "--concurrency", "3", "--no-projection"],
               match="the file has concurrencies 1 16")  # fmt: skip
    user_error(capsys, ["tune", "--results", str(tmp_path / "missing.json")],
               match="no results file")  # fmt: skip


def test_tune_keeps_contexts_apart(tmp_path, capsys):
    """Released-shape files hold two contexts per concurrency: each gets its own baseline, best K
    and table (a context-8k row must not overwrite the 1k table nor borrow the 1k baseline)."""
    configs = {}
    for ctx, scale in ((1024, 1.0), (8192, 0.5)):
        configs[f"none,K=0,C=1,ctx={ctx}"] = dict(row("none", 0, 1, 100 * scale, 1.0), context=ctx)
        for k, p in ((1, 120), (3, 150)):
            configs[f"peagle,K={k},C=1,ctx={ctx}"] = dict(
                row("peagle", k, 1, p * scale), context=ctx
            )
    path = tmp_path / "released.json"
    path.write_text(json.dumps({"configs": configs}))
    assert main(["tune", "--results", str(path), "--json", "--no-projection"]) == 0
    out = {a["context"]: a for a in json.loads(capsys.readouterr().out)}
    assert sorted(out) == [1024, 8192]
    assert (
        out[8192]["none_tokens_per_s"] == 50 and out[8192]["best"]["peagle"]["tokens_per_s"] == 75
    )
    assert {r["k"]: r["peagle"]["speedup"] for r in out[8192]["table"]} == {1: 1.2, 3: 1.5}
    assert main(["tune", "--results", str(path), "--context", "8192"]) == 0
    text = capsys.readouterr().out
    assert "concurrency 1, context 8192" in text and "context 1024" not in text
    with pytest.raises(ValueError, match="mix contexts"):
        tune.analyse(tune.measured_rows({"configs": configs}), 1)


def test_tune_rounds_a_speedup_once():
    """1.4049x prints as 1.40x (rounding to 3 places first printed 1.41x)."""
    rows = [row("none", 0, 1, 134.65), row("eagle3", 3, 1, 189.17)]
    assert "1.40x over none" in "\n".join(tune.format_analysis(tune.analyse(rows, 1)))


def test_tune_refuses_a_file_that_is_not_e2e_results(tmp_path, capsys):
    path = tmp_path / "verify.json"
    path.write_text(json.dumps({"rows": []}))
    user_error(capsys, ["tune", "--results", str(path)], match="not an e2e results file")


# ---------------------------------------------------------------------------------------------
# bench ops / CLI
# ---------------------------------------------------------------------------------------------


def test_help_lists_bench_and_tune():
    text = build_parser().format_help()
    assert "bench" in text and "tune" in text and "peagle bench e2e" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
@pytest.mark.parametrize(
    "family",
    ["prep", "verify", "attention", "kv", "all", "prepare_draft_inputs", "verify_chain",
     "paged_attention", "write_kv_cache"],
)  # fmt: skip
def test_bench_ops_refuses_without_cuda(family, tmp_path, capsys):
    argv = ["bench", "ops", family, *([] if family == "all" else ["--out", str(tmp_path / "x")])]
    user_error(capsys, argv, match="needs a CUDA GPU")
    assert not list(tmp_path.iterdir())


def test_results_json_schema(tmp_path, monkeypatch):
    monkeypatch.setenv("PEAGLE_COMMIT", "0123456789ab")
    res = timing.Results(copy_ceiling_gbps=4321.06, extra={"k": 7})
    res.add("B=1,K=7,H=4096,graph", "peagle", 7.9876, 123.45, kernels=1)
    res.add("B=1,K=7,H=4096,graph", "vllm-multiop", 41.0, None)
    out = tmp_path / "sub" / "prep-h200.json"
    res.write(out)
    d = json.loads(out.read_text())
    assert {"gpu", "commit", "command", "copy_ceiling_gbps", "rows", "torch"} <= set(d)
    assert d["commit"] == "0123456789ab" and d["copy_ceiling_gbps"] == 4321.1 and d["k"] == 7
    assert d["rows"][0] == {"case": "B=1,K=7,H=4096,graph", "impl": "peagle",
                            "median_us": 7.988, "gbps": 123.5, "kernels": 1}  # fmt: skip
    assert d["rows"][1]["gbps"] is None
    assert [p.name for p in out.parent.iterdir()] == ["prep-h200.json"]  # no temporary left


def test_report_parses_timing_modes():
    base = "B=1,K=7,H=8"
    cases = [(f"{base},graph", "graph", base), (f"{base},eager", "eager", base),
             (f"{base},eager-throughput", "eager-throughput", base),
             ("B1_q14_h64-8_d64_kv4096", "graph", "B1_q14_h64-8_d64_kv4096")]  # fmt: skip
    for case, mode, want in cases:
        r = {"case": case}
        assert report.mode_of(r) == mode and report.case_of(r) == want
    assert report.mode_of({"case": "x", "mode": "eager"}) == "eager"


@requires_cuda
@pytest.mark.serial  # compares GPU times: other processes' kernels would time-slice with it
def test_eager_throughput_matches_a_known_kernel():
    """N back-to-back calls of a ~fixed-length kernel: throughput ~ its GPU time, per-call eager
    median >= it (the event pair per call adds nothing to remove)."""
    torch.cuda._sleep(1000)
    fn = lambda i: torch.cuda._sleep(200_000)
    graph = timing.bench_graph(fn, calls_per_graph=10, replays=10)
    tput = timing.bench_eager_throughput(fn, calls=50, repeats=3)
    assert tput == pytest.approx(graph, rel=0.25)
    assert timing.bench_eager(fn, iters=30) >= 0.9 * tput
    with pytest.raises(ValueError):
        timing.bench_eager_throughput(fn, calls=0)


# ---------------------------------------------------------------------------------------------
# report + plots
# ---------------------------------------------------------------------------------------------


def test_report_writes_tables_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    results, docs = tmp_path / "results", tmp_path / "docs"
    results.mkdir()
    prep = timing.Results(copy_ceiling_gbps=4000.0)
    for mode, p, v in (("graph", 8.0, 66.0), ("eager", 20.0, 300.0),
                       ("eager-throughput", 12.0, 200.0)):  # fmt: skip
        prep.add(f"B=64,K=7,H=4096,{mode}", "peagle", p, 1000.0)
        prep.add(f"B=64,K=7,H=4096,{mode}", "vllm-multiop", v, 100.0)
    prep.write(results / "prep-h200.json")
    (results / "e2e-h200.json").write_text(json.dumps(synthetic_e2e()))
    written = report.generate(results, docs)
    names = {p.name for p in written}
    assert names == {"results.md", "kernels-h200.png", "e2e-tokens-per-s-vs-k.png",
                     "e2e-speedup-vs-concurrency.png"}  # fmt: skip
    for p in written:
        assert p.stat().st_size > 1000, p
    md = (docs / "results.md").read_text()
    assert "Eager, back to back" in md and "| B=64,K=7,H=4096 | 12.0 | 200.0 | 16.7x |" in md
    assert "best K for peagle: **K=3**" in md and "PROJECTION" in md
    assert "(e2e-speedup-vs-concurrency.png)" in md


def test_report_adds_h100_attention_section(tmp_path):
    # A FlashInfer comparison measured on an H100 (attention-h100.json) gets its own section, its
    # tally counted from its own rows.
    pytest.importorskip("matplotlib")
    results, docs = tmp_path / "results", tmp_path / "docs"
    results.mkdir()
    att = timing.Results(copy_ceiling_gbps=3000.0)
    att.add("B1_q14_h64-8_d64_kv1024", "peagle", 9.8, 200.0)
    att.add("B1_q14_h64-8_d64_kv1024", "flashinfer-xqa", 9.9, 198.0)
    att.add("B1_q14_h32-8_d128_kv1024", "peagle", 11.2, 380.0)
    att.add("B1_q14_h32-8_d128_kv1024", "flashinfer-decode-fa2", 10.4, 400.0)
    att.write(results / "attention-h100.json")
    report.generate(results, docs)
    md = (docs / "results.md").read_text()
    assert "## paged_attention vs FlashInfer on the H100" in md
    assert "| B1_q14_h64-8_d64_kv1024 | xqa | 9.9 | 9.8 | 1.01x |" in md
    assert "ahead of the best backend at 1 of 2 cases" in md


def test_plots_skip_empty_results(tmp_path):
    pytest.importorskip("matplotlib")
    from peagle.bench import plots

    empty = {"configs": {}, "projection": {}}
    assert plots.tokens_per_s_vs_k(empty, tmp_path / "a.png") is None
    assert plots.speedup_vs_concurrency(empty, tmp_path / "b.png") is None
    assert plots.kernels_pct_of_ceiling({}, tmp_path / "c.png") is None
    assert not list(tmp_path.iterdir())


def test_kv_benchmark_checks_its_peer_on_cpu():
    from peagle.bench.write_kv_cache import K, KVCase

    c = KVCase(b=3, hkv=2, d=8, n_sets=2, ctx=40, dtype=torch.float32, device="cpu")
    assert c.t == 3 * (K + 1) and len(set(c.slots[0].tolist())) == c.t
    c.check()
    kc, _ = c.caches["peagle"]
    assert kc.abs().sum() > 0 and kc[0].abs().sum() == 0  # block 0 (null) never written
    c.caches["torch-index-copy"][0][0, 0].fill_(1.0)  # a cell neither writes: must be caught
    with pytest.raises(AssertionError, match="disagree"):
        c.check()


def test_bench_report_refuses_an_empty_results_dir(tmp_path, capsys):
    """Without results it must not overwrite docs/results.md with an empty report."""

    docs = tmp_path / "docs"
    argv = ["bench", "report", "--results-dir", str(tmp_path / "none"), "--docs-dir", str(docs)]
    user_error(capsys, argv, match=r"no \*-h200.json results")
    assert not docs.exists()


def test_tune_run_prints_its_tables_once(tmp_path, capsys):
    """`peagle tune --run` measured first and then printed the tables a second time."""
    from peagle.cli import main

    rc = main(["tune", "--run", "--device", "cpu", "--results", str(tmp_path / "e2e.json"),
               "--k", "1", "--concurrency", "1", "--num-prompts", "1", "--max-new-tokens", "3",
               "--methods", "none", "peagle"])  # fmt: skip
    assert rc == 0
    assert capsys.readouterr().out.count("no speculation:") == 1


def test_ab_compare_reads_graph_rows_not_eager(tmp_path):
    # The verify family records a graph and an eager row per case; the eager one (later in the
    # file) once replaced the graph median in the A/B ratio.
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "ab_compare.py"
    spec = importlib.util.spec_from_file_location("ab_compare", path)
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    for side, graph_us, eager_us in (("old", 10.0, 30.0), ("new", 12.0, 31.0)):
        rows = [
            {"case": "c", "impl": "peagle", "median_us": graph_us, "mode": "graph"},
            {"case": "c", "impl": "vllm-multiop", "median_us": 99.0, "mode": "graph"},
            {"case": "c", "impl": "peagle", "median_us": eager_us, "mode": "eager"},
        ]
        (tmp_path / f"ab-verify-{side}1.json").write_text(json.dumps({"rows": rows}))
    out = tmp_path / "cmp.json"
    assert ab.main([str(tmp_path), "--json", str(out), "--command", "x"]) == 0
    rec = json.loads(out.read_text())
    assert rec["command"] == "x"
    assert [r["new_over_old"] for r in rec["rows"]] == [1.2]


def test_flashinfer_report_sums_the_sampling_path_and_flags_failed_checks():
    from peagle.bench import flashinfer_report

    def row(case, impl, us, p=None):
        return {"case": case, "impl": impl, "median_us": us, "mode": "graph", "chi2_p": p}

    d = {"flashinfer": {"version": "9.9", "errors": {}}, "rows": [
        row("greedy", "peagle", 5.0),  # no FlashInfer row: not a random case, left out
        row("tk", "peagle", 10.0, 0.5), row("tk", "flashinfer-chain", 30.0, 0.2),
        row("tk", "flashinfer-bonus-tktp", 20.0, 1e-5),
    ]}  # fmt: skip
    text = "\n".join(flashinfer_report.verify_section(d))
    assert "| tk | 10.0 | 0.5 | 30.0 | 0.2 | 20.0 | 1e-05 **fails** | 50.0 | 5.0x |" in text
    assert "greedy" not in text


def test_flashinfer_report_picks_the_fastest_backend_and_lists_errors():
    from peagle.bench import flashinfer_report

    rows = [{"case": "a", "impl": "peagle", "median_us": 10.0},
            {"case": "a", "impl": "flashinfer-xqa", "median_us": 8.0},
            {"case": "a", "impl": "flashinfer-fa3", "median_us": 20.0},
            {"case": "b", "impl": "peagle", "median_us": 10.0},
            {"case": "b", "impl": "flashinfer-fa3", "median_us": 15.0}]  # fmt: skip
    d = {"commit": "c", "flashinfer": {"version": "9.9", "errors": {"a": {"flashinfer-fa2": "E"}}},
         "rows": rows}  # fmt: skip
    ab = {"rows": [{"family": "attention", "case": "a", "old_us": [7.5, 7.0]}]}
    text = "\n".join(flashinfer_report.attention_section(d, ab))
    assert "| a | xqa | 8.0 | 10.0 | 0.80x | 7.0 (1.14x) |" in text
    assert "| b | fa3 | 15.0 | 10.0 | 1.50x | — |" in text
    assert "at 1 of 2 cases in the same run; its default path (A/B file) at 1 of 1." in text
    assert "* `flashinfer-fa2`: E" in text
    # Without an A/B file the same-run rows are the default path: no extra column.
    text = "\n".join(flashinfer_report.attention_section(d))
    assert "| a | xqa | 8.0 | 10.0 | 0.80x |\n" in text + "\n"
    assert "A/B file" not in text


def test_report_reads_flashinfer_rows_from_the_attention_file(tmp_path):
    """One attention run with FlashInfer rows feeds both sections; the old fa2 figures drop out."""
    times = (("peagle", 16.5), ("sdpa", 26.8), ("flashinfer-decode-fa2", 16.0))
    rows = [{"case": "B1_q14_h32-8_d128_kv4096", "impl": i, "median_us": us, "mode": "graph",
             "gbps": 1.0, "pct_of_copy": 1.0} for i, us in times]  # fmt: skip
    d = {"gpu": "G", "commit": "c", "command": "x", "copy_ceiling_gbps": 4000.0, "rows": rows,
         "flashinfer": {"version": "9.9", "errors": {}}}  # fmt: skip
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "attention-h200.json").write_text(json.dumps(d))
    report.generate(tmp_path / "results", tmp_path / "docs")
    text = (tmp_path / "docs" / "results.md").read_text()
    assert "## paged_attention vs FlashInfer" in text
    assert "| B1_q14_h32-8_d128_kv4096 | decode-fa2 | 16.0 | 16.5 | 0.97x |" in text
    assert "FlashInfer 0.2.8" not in text


def test_verify_bench_filter_selects_cases_by_name(monkeypatch):
    """`peagle bench ops verify --filter` times only the cases whose name holds a filter string."""
    from peagle.bench import verify_chain as vb

    seen = []
    monkeypatch.setattr(vb, "copy_ceiling_gbps", lambda: 4000.0)
    monkeypatch.setattr(vb, "run_case", lambda res, b, v, mode, *a, **k: seen.append(
        vb.case_name(b, v, mode)))  # fmt: skip
    vb.main(["--no-flashinfer", "--filter", "top_k", "B=8,K=7,V=151936,greedy"])
    assert seen == ["B=8,K=7,V=151936,greedy", "B=1,K=7,V=201088,T=0.7,top_k=50,top_p=0.9",
                    "B=64,K=7,V=201088,T=0.7,top_k=50,top_p=0.9"]  # fmt: skip


def test_print_table_without_rows_prints_the_header(capsys):
    """A filter that matches no case leaves no rows; the table still prints (its header)."""
    timing.print_table([], ["case", "median_us"])
    assert capsys.readouterr().out.split() == ["case", "median_us"]


def test_ab_compare_times_each_variant_against_old(tmp_path, capsys):
    # tools/h200.sh ab with AB_VARIANTS: ab-<family>-<name><rep>.json per extra tree.
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "ab_compare.py"
    spec = importlib.util.spec_from_file_location("ab_compare", path)
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    for side, us in (("old", 10.0), ("new", 9.0), ("varA", 12.0), ("var_b", 8.0)):
        for rep in (1, 2):
            rows = [{"case": "c", "impl": "peagle", "median_us": us + rep / 10, "mode": "graph"}]
            (tmp_path / f"ab-attention-{side}{rep}.json").write_text(json.dumps({"rows": rows}))
    out = tmp_path / "cmp.json"
    assert ab.main([str(tmp_path), "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    got = {r.get("variant", "new"): r["new_over_old"] for r in rec["rows"]}
    assert got == {"new": round(9.1 / 10.1, 4), "varA": round(12.1 / 10.1, 4),
                   "var_b": round(8.1 / 10.1, 4)}  # fmt: skip
    assert "variant varA (as new):" in capsys.readouterr().out


def test_h200_sh_abverify_tests_and_times_each_variant(tmp_path):
    # tools/h200.sh abverify with AB_VARIANTS: every extra tree is built, run under the verify
    # tests with its own build first on the path, and timed after new in both rounds.
    import re
    import shutil
    import subprocess
    import tarfile
    from pathlib import Path

    if shutil.which("bash") is None or shutil.which("tar") is None:
        pytest.skip("no bash / tar")
    script = (Path(__file__).resolve().parent.parent / "tools" / "h200.sh").read_text()
    func = re.search(r"^run_abverify\(\) \{.*?^\}", script, re.S | re.M).group(0)
    stubs = (
        'build_old() { echo "$1" > "$OUT/build-old.log"; }\n'
        'build_tree() { echo "$1 $2" > "$3"; }\n'
        'timeout() { shift; "$@"; }\n'
        'python3() { if [ "$2" = pytest ]; then echo "1 passed (${PYTHONPATH:-installed})";'
        ' else echo "{\\"site\\": \\"${PYTHONPATH:-installed}\\"}"; fi; }\n'
    )
    out = tmp_path / "out"
    out.mkdir()

    def run(variants: str) -> subprocess.CompletedProcess:
        env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "AB_VARIANTS": variants}
        return subprocess.run(["bash", "-c", f"{stubs}{func}\nrun_abverify .ab/old"], env=env,
                              capture_output=True, text=True)  # fmt: skip

    res = run("x/varA y/var_b")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "verify tests (varA): rc=0 1 passed (/tmp/site-varA)" in lines[1]
    assert "verify tests (var_b): rc=0 1 passed (/tmp/site-var_b)" in lines[2]
    timed = [ln.split(":")[0] for ln in lines[3:]]
    assert timed == [f"{side}{rep} {kind}" for rep in (1, 2)
                     for side in ("old", "new", "varA", "var_b")
                     for kind in ("chunks", "default")]  # fmt: skip
    sites = {ln.split(":", 1)[0]: ln.split('"site": "')[1].rstrip('"}') for ln in lines[3:]}
    assert sites["old1 chunks"] == "/tmp/oldsite"
    assert sites["new2 default"] == "installed"
    assert sites["var_b1 default"] == "/tmp/site-var_b"
    with tarfile.open(out / "abverify.tgz") as tf:
        names = set(tf.getnames())
    assert {"abv-default-varA2.log", "abv-tests-var_b.log", "build-varA.log"} <= names
    bad = run("x/bad-name")
    assert bad.returncode == 2 and "must be letters and underscores" in bad.stdout


def test_h200_sh_names_results_after_the_card_it_ran_on(tmp_path):
    # A device call for the H200 may run on an H100: tools/h200.sh's bench and flashinfer results
    # are named <family>-<gpu_tag>.json, so an H100 run is not filed as an H200 one.
    import re
    import shutil
    import subprocess
    from pathlib import Path

    if shutil.which("bash") is None:
        pytest.skip("no bash")
    script = (Path(__file__).resolve().parent.parent / "tools" / "h200.sh").read_text()
    func = re.search(r"^gpu_tag\(\) \{.*?^\}", script, re.S | re.M).group(0)
    assert script.count('--out "$OUT/$fam-$(gpu_tag).json"') == 2  # bench and flashinfer
    fake = tmp_path / "nvidia-smi"
    got = {}
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA B200"):
        fake.write_text(f'#!/bin/sh\necho "{name}"\n')
        fake.chmod(0o755)
        env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
        res = subprocess.run(["bash", "-c", f"{func}\ngpu_tag"], env=env, capture_output=True,
                             text=True, check=True)  # fmt: skip
        got[name] = res.stdout.strip()
    assert got == {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200", "NVIDIA B200": "b200"}


def test_verify_bench_set_acceptance_gives_drafts_that_probability():
    """The verify benchmark's ``accept=A`` cases: each draft gets target probability A at the
    case's temperature (1: certain), the other rows stay as they were."""
    from peagle.bench.verify_chain import accept_of, set_acceptance

    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(12, 50000, generator=g) * 3.0).to(torch.bfloat16)
    rows = torch.arange(0, 12, 2)
    drafts = torch.randint(0, 50000, (6,), generator=g, dtype=torch.int32)
    for a, tol in ((0.6, 0.03), (0.2, 0.03), (1.0, 1e-6)):
        lg = logits.clone()
        set_acceptance(lg, rows, drafts, 0.7, a)
        p = torch.softmax(lg[rows].float() / 0.7, dim=1).gather(1, drafts.long().view(-1, 1))
        torch.testing.assert_close(p.squeeze(1), torch.full((6,), a), rtol=0, atol=tol)
        assert torch.equal(lg[1::2], logits[1::2])
    assert accept_of("T=0.7,accept=0.6") == 0.6
    assert accept_of("T=0.7,accept=1") == 1.0
    assert accept_of("T=0.7") is None
