"""``peagle bench e2e`` on the CPU with tiny settings: schema, resumable chunks, greedy outputs
identical across methods, held-out prompts, and the projection's code path."""

from __future__ import annotations

import json
import math

import pytest

from peagle import default_models
from peagle.bench import e2e, projection
from peagle.cli import main

pytestmark = pytest.mark.skipif(not default_models.available(), reason="no default pair")

TINY = ["--device", "cpu", "--k", "2", "--concurrency", "1", "2", "--num-prompts", "2",
        "--max-new-tokens", "8"]  # fmt: skip
ROW_KEYS = {
    "method", "k", "concurrency", "num_requests", "max_new_tokens", "output_tokens", "wall_s",
    "tokens_per_s", "tpot_ms", "acceptance_length", "tokens_per_step", "steps",
    "per_position_acceptance", "target_ms_per_step", "drafter_ms_per_step",
    "overhead_ms_per_step", "cuda_graphs", "outputs_sha1", "commit",
}  # fmt: skip


def test_plan_runs_none_once_per_concurrency():
    got = e2e.plan(["peagle", "eagle3", "none"], [1, 3], [1, 16])
    assert got == [("none", 0, 1), ("peagle", 1, 1), ("eagle3", 1, 1), ("peagle", 3, 1),
                   ("eagle3", 3, 1), ("none", 0, 16), ("peagle", 1, 16), ("eagle3", 1, 16),
                   ("peagle", 3, 16), ("eagle3", 3, 16)]  # fmt: skip
    assert e2e.config_key("none", 7, 4) == "none,K=0,C=4"


def test_e2e_resumes_in_chunks_and_merges(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    # Chunk 1: a config limit stops the run with work left -> 75.
    assert main(["bench", "e2e", *TINY, "--out", str(out), "--max-configs", "2"]) == 75
    first = json.loads(out.read_text())
    assert list(first["configs"]) == ["none,K=0,C=1", "peagle,K=2,C=1"]
    # Chunk 2: a tiny time limit still makes progress (one config), then stops -> 75.
    assert main(["bench", "e2e", *TINY, "--out", str(out), "--max-minutes", "1e-6"]) == 75
    second = json.loads(out.read_text())
    assert len(second["configs"]) == 3
    # Chunk 3: finishes -> 0; finished configs are kept, not re-run.
    assert main(["bench", "e2e", *TINY, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(data["configs"]) == 6  # 2 concurrencies x (none + 2 methods x 1 K)
    for key, row in first["configs"].items():
        assert data["configs"][key] == row
    for key in ("gpu", "commit", "command", "torch", "settings", "prompts"):
        assert key in data
    assert data["gpu"] == "cpu" and data["settings"]["max_new_tokens"] == 8
    assert data["prompts"] == e2e._prompts(1)[1]  # what the prompts are: the shipped pair's record
    for key, row in data["configs"].items():
        assert set(row) >= ROW_KEYS, key
        assert e2e.config_key(row["method"], row["k"], row["concurrency"]) == key
        assert row["output_tokens"] == 2 * 8  # EOS ignored: every request runs to the budget
        assert row["tokens_per_s"] == pytest.approx(row["output_tokens"] / row["wall_s"], 0.01)
        if row["method"] == "none":
            assert row["acceptance_length"] == 1.0 and row["steps"] >= 8
        else:
            assert 1.0 <= row["acceptance_length"] <= row["k"] + 1
            assert len(row["per_position_acceptance"]) == row["k"]
    # Greedy: every method emits the target's own greedy tokens.
    assert len({r["outputs_sha1"] for r in data["configs"].values()}) == 1
    # A rerun with everything done measures nothing and exits 0.
    assert main(["bench", "e2e", *TINY, "--out", str(out)]) == 0
    assert json.loads(out.read_text())["configs"] == data["configs"]
    assert "best K for P-EAGLE" in capsys.readouterr().out


def test_e2e_refuses_to_merge_other_settings(tmp_path):
    out = tmp_path / "e2e.json"
    res = e2e.ResultsFile(out, {"max_new_tokens": 4})
    res.configs["none,K=0,C=1"] = {"method": "none"}
    res.write()
    assert not list(tmp_path.glob(".*tmp*"))  # atomic write: no temporary file left
    assert e2e.ResultsFile(out, {"max_new_tokens": 4}).configs == res.configs
    with pytest.raises(SystemExit, match=r"other settings \(max_new_tokens: 4 there, 5 now\)"):
        e2e.ResultsFile(out, {"max_new_tokens": 5})


def test_e2e_resume_ignores_settings_this_run_does_not_use(tmp_path):
    """A run without --projection resumes a file whose projection_shape differs (a new user's
    smoke run was refused over it)."""
    out = tmp_path / "e2e.json"
    e2e.ResultsFile(out, {"max_new_tokens": 4, "projection_shape": "1b"}).write()
    new = {"max_new_tokens": 4, "projection_shape": "tiny"}
    assert e2e.ResultsFile(out, new, ignore=("projection_shape",)).configs == {}
    with pytest.raises(SystemExit, match="projection_shape"):
        e2e.ResultsFile(out, new)


def test_held_out_prompts_come_from_held_out_modules():
    from transformers import AutoTokenizer

    from peagle.bench.prompts import held_out_prompts

    tok = AutoTokenizer.from_pretrained(str(default_models.target_dir()))
    modules = ["json", "csv", "difflib", "heapq", "textwrap"]  # a v1/v2 record's kind of list
    a = held_out_prompts(tok, 5, modules)
    b = held_out_prompts(tok, 7, modules)
    assert [p["prompt"] for p in a] == [p["prompt"] for p in b[:5]]  # same sequence, extended
    for p in b:
        top = p["path"].split("/")[0].removesuffix(".py")
        assert top in modules
        assert p["token_ids"] and max(p["token_ids"]) < tok.vocab_size + len(tok.get_added_vocab())


def test_projection_times_the_engine_passes(tmp_path, monkeypatch):
    """The drafter runs ONE pass over 2K rows per request for P-EAGLE and K passes for EAGLE-3,
    through the engine's own draft path."""
    shape = projection.TINY_SHAPE
    target = projection.build_target(shape, "cpu", projection.torch.float32)
    k, c = 3, 2
    # P-EAGLE: one pass over [K+1 verified rows | K-1 mask rows] = 2K rows per request.
    # EAGLE-3: a first pass over the K+1 verified rows, then K-1 one-row passes.
    for method, rows in (("peagle", [c * 2 * k]), ("eagle3", [c * (k + 1)] + [c] * (k - 1))):
        drafter = projection.build_drafter(shape, method, target)
        seen = []
        orig = type(drafter).forward

        def spy(self, input_ids, *a, _orig=orig, _seen=seen, **kw):
            _seen.append(input_ids.shape[0])
            return _orig(self, input_ids, *a, **kw)

        monkeypatch.setattr(type(drafter), "forward", spy)
        t = projection.time_passes(target, drafter, method, k, c, shape, replays=2)
        monkeypatch.setattr(type(drafter), "forward", orig)
        assert t["t_verify_ms"] > 0 and t["t_draft_ms"] > 0
        calls = 1 + 2  # time_fn: one warm-up call + 2 timed replays
        assert seen == rows * calls, (method, seen)
    t = projection.time_passes(target, None, "none", k, c, shape, replays=1)
    assert t["t_draft_ms"] == 0.0 and t["t_verify_ms"] > 0


def test_projection_cli_rows_are_labelled(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    argv = ["bench", "e2e", "--device", "cpu", "--projection-only", "--projection-shape", "tiny",
            "--k", "2", "--concurrency", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["configs"] == {}
    assert set(data["projection"]) == {"none,K=0,C=1", "peagle,K=2,C=1", "eagle3,K=2,C=1"}
    assert all(r["projection"] is True for r in data["projection"].values())
    assert "hidden 128" in data["projection_shape"]["description"]
    printed = capsys.readouterr().out
    assert "[PROJECTION]" in printed


def test_project_formula_and_sources():
    timings = {
        "peagle,K=3,C=4": {"method": "peagle", "k": 3, "concurrency": 4, "t_verify_ms": 2.0,
                           "t_draft_ms": 1.0},
        "eagle3,K=3,C=4": {"method": "eagle3", "k": 3, "concurrency": 4, "t_verify_ms": 2.0,
                           "t_draft_ms": 3.0},
        "none,K=0,C=4": {"method": "none", "k": 0, "concurrency": 4, "t_verify_ms": 1.5,
                         "t_draft_ms": 0.0},
    }  # fmt: skip
    measured = {
        "peagle,K=3,C=4": {"method": "peagle", "k": 3, "concurrency": 4,
                           "acceptance_length": 2.5, "overhead_ms_per_step": 1.0},
    }  # fmt: skip
    rows = {r["method"]: r for r in projection.project(timings, measured, {"eagle3": {"3": 2.0}})}
    p = rows["peagle"]
    assert p["projection"] is True and p["al_source"] == "e2e" and p["overhead_source"] == "e2e"
    assert p["tokens_per_s"] == pytest.approx(4 * 2.5 / ((2.0 + 1.0 + 1.0) / 1e3), rel=1e-3)
    e = rows["eagle3"]
    assert e["al_source"] == "pair.json" and e["acceptance_length"] == 2.0
    assert e["overhead_source"] == "e2e (all configs)"  # no eagle3 row: median of all rows
    assert e["tokens_per_s"] == pytest.approx(4 * 2.0 / ((2.0 + 3.0 + 1.0) / 1e3), rel=1e-3)
    n = rows["none"]
    assert n["acceptance_length"] == 1.0
    assert n["tokens_per_s"] == pytest.approx(4 / ((1.5 + 1.0) / 1e3), rel=1e-3)


def test_tune_run_measures_first(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    argv = ["tune", "--run", "--device", "cpu", "--methods", "none", "peagle", "--k", "1",
            "--concurrency", "1", "--num-prompts", "1", "--max-new-tokens", "4",
            "--results", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert set(json.loads(out.read_text())["configs"]) == {"none,K=0,C=1", "peagle,K=1,C=1"}
    assert "best K for P-EAGLE:  K=1" in capsys.readouterr().out


def _fake_pair(root, record: dict, rows: list[dict] | None = None) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "pair.json").write_text(json.dumps(record))
    if rows is not None:
        (root / "eval_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_e2e_prompts_of_a_v3_record_are_its_shipped_evaluation_prompts(tmp_path, monkeypatch):
    """A v3 pair.json has no corpus.held_out_modules: bench e2e takes the evaluation split's
    prompts the pair ships (pair.json eval_prompts), in order; a v2 record still rebuilds its
    stdlib prompts; a record with neither is a clear error."""
    from transformers import AutoTokenizer

    from peagle.bench.prompts import held_out_prompts
    from peagle.errors import UserError

    # the shipped (v3) pair: its evaluation prompts, in order
    info = default_models.info()
    shipped = default_models.eval_prompts()
    ids, meta = e2e._prompts(3)
    assert ids == [list(r["token_ids"]) for r in shipped[:3]]
    assert meta["held_out_distributions"] == info["corpus"]["evaluation"]["distribution_list"]

    # a v2 record (stdlib modules of the running interpreter), with the shipped tokenizer
    target_dir = default_models.target_dir()
    v2 = {"recipe": "gpu-v2", "corpus": {"held_out_modules": ["json", "csv", "heapq"]},
          "eval": {"max_new_tokens": 96}}  # fmt: skip
    _fake_pair(tmp_path / "v2", v2)
    with monkeypatch.context() as m:
        m.setattr(default_models, "ROOT", tmp_path / "v2")
        m.setattr(default_models, "target_dir", lambda: target_dir)
        v2_ids, v2_meta = e2e._prompts(3)
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    ref = held_out_prompts(tok, 3, ["json", "csv", "heapq"], prompt_tokens=96, new_tokens=96)
    assert v2_ids == [p["token_ids"] for p in ref]
    assert v2_meta["held_out_modules"] == ["json", "csv", "heapq"]

    rows = [{"token_ids": [i, i + 1, i + 2], "prompt": "x", "unit": "pkg", "path": "p.py"}
            for i in range(3)]  # fmt: skip
    v3 = {
        "recipe": "gpu-v3",
        "corpus": {"evaluation": {"distribution_list": ["pathspec==0.12.1", "yarl==1.9"]}},
        "eval_prompts": {"file": "eval_prompts.jsonl", "split": "evaluation", "prompts": 3,
                         "prompt_tokens": 3},
    }  # fmt: skip
    _fake_pair(tmp_path / "v3", v3, rows)
    monkeypatch.setattr(default_models, "ROOT", tmp_path / "v3")
    ids, meta = e2e._prompts(2)
    assert ids == [[0, 1, 2], [1, 2, 3]]
    assert meta["source"] == "eval_prompts.jsonl" and meta["split"] == "evaluation"
    assert meta["held_out_distributions"] == ["pathspec==0.12.1", "yarl==1.9"]
    with pytest.raises(UserError, match="ships 3 held-out evaluation prompts"):
        e2e._prompts(4)
    _fake_pair(tmp_path / "none", {"recipe": "x", "corpus": {}})
    monkeypatch.setattr(default_models, "ROOT", tmp_path / "none")
    with pytest.raises(UserError, match="names no held-out prompts"):
        e2e._prompts(1)


def test_run_config_through_the_graph_layout():
    """cuda_graphs="emulate" runs the CUDA-graph static-buffer path eagerly (capture_all
    included): same greedy tokens as the plain eager loop."""
    ids, _ = e2e._prompts(3)
    pairs = e2e._load_pair("cpu", projection.torch.float32, ["peagle", "eagle3"])
    for method in ("peagle", "eagle3"):
        target, drafter = pairs[method]
        rows = [e2e.run_config(target, drafter, method, 3, 2, ids, 10, graphs)
                for graphs in ("off", "emulate")]  # fmt: skip
        assert rows[0]["outputs_sha1"] == rows[1]["outputs_sha1"]
        assert rows[0]["acceptance_length"] == rows[1]["acceptance_length"]
        assert rows[1]["output_tokens"] == 30 and rows[1]["num_requests"] == 3


def test_projection_label_names_the_recorded_shape():
    from peagle.bench import tune

    assert tune.projection_label({"projection_shape": projection.ProjectionShape().to_dict()}) == (
        "projection: ~1B random-weight target"
    )
    tiny = tune.projection_label({"projection_shape": projection.TINY_SHAPE.to_dict()})
    assert "~1B" not in tiny and "hidden 128, 4 layers" in tiny


def test_dry_run_of_the_packaged_pair_runs_nothing(tmp_path, capsys, monkeypatch):
    """--dry-run on the packaged pair printed nothing of a plan and ran the whole grid (10+
    minutes on a CPU); it prints each config's expected AL (pair.json) and steps, and loads no
    model."""

    def no_load(*a, **k):
        raise AssertionError("a dry run loaded the pair")

    monkeypatch.setattr(e2e, "_load_pair", no_load)
    out = tmp_path / "e2e.json"
    argv = ["bench", "e2e", "--device", "cpu", "--k", "1", "7", "--concurrency", "1", "8",
            "--num-prompts", "16", "--max-new-tokens", "33", "--dry-run", "--assume-step-ms",
            "2", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert not out.exists()
    al = default_models.info()["acceptance_length"]["peagle"]["7"]
    row = next(line.split() for line in text.splitlines() if line.startswith("peagle,K=7,C=8"))
    # 2 waves of 8 requests, each one prefill step + ceil(32 / AL) decode steps
    steps = 2 * (1 + math.ceil(32 / al))
    assert row[1:] == ["16", str(round(al, 3)), str(steps), str(round(steps * 2 / 6e4, 2))]
    none = next(line.split() for line in text.splitlines() if line.startswith("none,K=0,C=1"))
    assert none[2:4] == ["1.0", str(16 * 33)]
    assert "total at the assumed step time" in text
