"""scripts/train_default_pair.py: the chunked, resumable run (exit 75 = run again, 0 = done) on a
tiny recipe and a slice of the stdlib, and the GPU recipe's --dry-run plan (no GPU needed)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import train_default_pair as script  # noqa: E402
from default_pair import report, stdlib_corpus  # noqa: E402
from default_pair.recipes import RECIPES, DrafterRecipe  # noqa: E402
from default_pair.target_lm import TargetRecipe, TargetShape  # noqa: E402

pytest.importorskip("tokenizers")

TINY = replace(
    RECIPES["smoke"],
    name="tiny-test",
    vocab_size=320,
    target=TargetShape(hidden_size=64, num_layers=4, intermediate_size=96, num_kv_heads=1),
    target_train=TargetRecipe(steps=3, batch_size=2, seq_len=32, lr=2e-3, warmup=1),
    peagle=DrafterRecipe(num_layers=1, intermediate_size=64, steps=2, seq_len=48, lr=1e-3, k=3),
    eagle3=DrafterRecipe(num_layers=1, intermediate_size=64, steps=2, seq_len=48, lr=1e-3, k=3),
    draft_vocab_size=200,
    eval_prompts=2,
    eval_prompt_tokens=16,
    eval_new_tokens=6,
    regen_prompts=6,
    regen_prompt_tokens=16,
    regen_new_tokens=16,
    regen_temperatures=(0.0, 0.7),
    regen_batch=2,
)


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    train, held = stdlib_corpus.load_stdlib()
    small = ([d for d in train if 2000 < len(d.text) < 20000][:8], held[:4])
    monkeypatch.setattr(stdlib_corpus, "load_stdlib", lambda: small)
    monkeypatch.setitem(RECIPES, TINY.name, TINY)
    monkeypatch.setattr(report, "DOCS_DIR", tmp_path / "docs")  # not the repo's docs/
    return tmp_path


def _run(work: Path, pkg: Path, *extra: str) -> int:
    argv = ["--recipe", TINY.name, "--work-dir", str(work), "--package-dir", str(pkg)]
    return script.main([*argv, "--threads", "1", *extra])


def test_chunked_run_resumes_and_never_redoes_a_finished_stage(tiny):
    # reference: regeneration in one go
    assert _run(tiny / "ref", tiny / "ref_pkg", "--until", "regen") == 0
    # chunks: a deadline that is always passed, so each call makes one unit of progress and
    # stops (exit 75) until everything is done (exit 0)
    work, codes = tiny / "chunked", []
    for _ in range(80):
        codes.append(_run(work, tiny / "pkg", "--max-minutes", "1e-9"))
        if codes[-1] != 75:
            break
        regen = work / "regen.jsonl"
        if regen.is_file() and not (work / "done.json").read_text().count('"regen"'):
            with open(regen, "ab") as f:  # a batch cut off by a kill mid-write
                f.write(b'{"input_ids": [1, 2')
    assert codes[-1] == 0 and set(codes[:-1]) == {75}, codes
    done = json.loads((work / "done.json").read_text())
    assert [s.name for s in script.STAGES if done[s.name]["done"]] == [
        s.name for s in script.STAGES
    ]
    log = (work / "log.txt").read_text()
    for s in script.STAGES:
        assert log.count(f"] stage {s.name}\n") >= 1
    # finished stages are never started again: each stage's line appears in one run of calls
    names = [s.name for s in script.STAGES]
    starts = [ln.split("] stage ")[1] for ln in log.splitlines() if "] stage " in ln]
    starts = [s for s in starts if s in names]
    assert starts == sorted(starts, key=names.index)
    # several calls per resumable stage: target steps, regen batches, measured Ks (the drafters'
    # --time-limit resume is tested in test_train_cli; their limit here floors at 1 s)
    for name in ("target", "regen", "measure"):
        assert starts.count(name) >= 2, (name, starts.count(name))
    # chunked regeneration wrote exactly what the uninterrupted run wrote
    assert (work / "regen.jsonl").read_bytes() == (tiny / "ref" / "regen.jsonl").read_bytes()
    res = json.loads((work / "results.json").read_text())
    assert sorted(res["heads"]) == ["eagle3", "peagle"]
    assert all(len(v) == 10 for v in res["heads"].values())
    assert (tiny / "docs" / f"default-model-pair-{TINY.name}.md").is_file()
    # a finished run is a no-op that exits 0
    assert _run(work, tiny / "pkg", "--max-minutes", "1e-9") == 0


def test_gpu_dry_run_plan_fits_budget(tmp_path, capsys):
    # v2 (the shipped pair); --device cuda's default is v3 (tests/test_default_pair_v3.py)
    argv = ["--device", "cuda", "--recipe", "gpu-v2", "--work-dir", str(tmp_path / "w")]
    rc = script.main([*argv, "--max-minutes", "8.5", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0
    assert not (tmp_path / "w").exists()  # touches nothing
    for s in ("target", "regen", "peagle", "eagle3", "measure"):
        assert f"  {s} " in out
    total = float(out.split("  total")[1].split()[0])
    assert 5.0 < total <= 20.0
    assert "recipe gpu" in out and "of 16 MiB" in out


def test_only_runs_the_heads_separately_and_keeps_each_others_done_marks(tiny):
    work, pkg = tiny / "split", tiny / "pkg"
    # a head cannot start before its data exists
    assert _run(work, pkg, "--only", "eagle3") == 2
    assert _run(work, pkg, "--until", "regen") == 0
    # the two heads as two processes would run them (eagle3 does not need peagle)
    assert _run(work, pkg, "--only", "eagle3") == 0
    done = json.loads((work / "done.json").read_text())
    assert done["eagle3"]["done"] and not done.get("peagle", {}).get("done")
    # a process that read done.json before eagle3 finished must not drop eagle3's mark
    stale = {k: v for k, v in done.items() if k != "eagle3"}
    script._save_done(work / "done.json", {**stale, "note": {"done": False}})
    done = json.loads((work / "done.json").read_text())
    assert done["eagle3"]["done"] and "note" in done
    assert _run(work, pkg, "--only", "peagle") == 0
    done = json.loads((work / "done.json").read_text())
    assert done["eagle3"]["done"] and done["peagle"]["done"]
    # the rest runs without redoing either head
    log_before = (work / "log.txt").read_text()
    assert _run(work, pkg) == 0
    after = (work / "log.txt").read_text()[len(log_before) :]
    assert "] stage peagle\n" not in after and "] stage eagle3\n" not in after
    assert "] stage measure\n" in after
