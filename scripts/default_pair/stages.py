"""The stages of scripts/train_default_pair.py; each returns True when finished."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from default_pair import stdlib_corpus
from default_pair.recipes import DrafterRecipe, Recipe
from default_pair.target_lm import export_target, train_target
from default_pair.tokenizer import EOS_TOKEN, MASK_TOKEN, load_tokenizer, train_tokenizer


@dataclass
class Context:
    work_dir: Path
    package_dir: Path
    recipe: Recipe
    device: torch.device
    deadline: float
    log: Callable[[str], None]
    info: dict
    attention: str = "auto"
    # True while no stage has run yet in this invocation: such a stage always makes progress
    # (a later one may decline to start when too little time is left).
    first_stage: bool = True
    # corpus v3 sources (tests point these at a small fake installation)
    corpus_paths: list[str] | None = None  # where distributions are looked up (None: sys.path)
    stdlib_root: Path | None = None  # the standard library directory (None: the interpreter's)
    include_stdlib: bool = True

    @property
    def tokenizer_dir(self) -> Path:
        return self.work_dir / "tokenizer"

    @property
    def target_dir(self) -> Path:
        return self.work_dir / "target"


DRAFTER_MIN_START_S = 90.0


@dataclass
class Stage:
    name: str
    run: Callable[[Context], bool]


def _v3(ctx: Context) -> bool:
    return ctx.recipe.corpus == "site"


def stage_tokenizer(ctx: Context) -> bool:
    if _v3(ctx):
        from default_pair import stages_v3

        return stages_v3.stage_tokenizer(ctx)
    train, held = stdlib_corpus.load_stdlib()
    ctx.log(
        f"stdlib {stdlib_corpus.stdlib_root()} (Python {stdlib_corpus.python_version()}): "
        f"{len(train)} training files ({sum(len(d.text) for d in train) / 1e6:.1f} MB), "
        f"{len(held)} held-out files of modules {', '.join(stdlib_corpus.HELD_OUT_MODULES)}"
    )
    tok = train_tokenizer((d.text for d in train), ctx.recipe.vocab_size, ctx.tokenizer_dir)
    ctx.info["corpus"] = {
        "python_version": stdlib_corpus.python_version(),
        "train_files": len(train),
        "train_bytes": sum(len(d.text.encode()) for d in train),
        "held_out_files": len(held),
        "held_out_modules": list(stdlib_corpus.HELD_OUT_MODULES),
        "vocab_size": len(tok),
    }
    return True


def stage_tokenize(ctx: Context) -> bool:
    if _v3(ctx):
        from default_pair import stages_v3

        return stages_v3.stage_tokenize(ctx)
    tok = load_tokenizer(ctx.tokenizer_dir)
    eos = tok.convert_tokens_to_ids(EOS_TOKEN)
    train, held = stdlib_corpus.load_stdlib()
    for name, docs in (("train", train), ("held_out", held)):
        ids = tok([d.text for d in docs], add_special_tokens=False)["input_ids"]
        stream = torch.tensor([t for seq in ids for t in (*seq, eos)], dtype=torch.int32)
        torch.save(stream, ctx.work_dir / f"{name}_stream.pt")
        with open(ctx.work_dir / f"{name}.jsonl", "w") as f:
            for d in docs:
                f.write(json.dumps({"text": d.text, "path": d.relpath}) + "\n")
        ctx.log(
            f"{name}: {len(docs)} files, {stream.numel()} tokens "
            f"({sum(len(d.text.encode()) for d in docs) / stream.numel():.2f} bytes/token)"
        )
        ctx.info.setdefault("corpus", {})[f"{name}_tokens"] = stream.numel()
    # Held-out evaluation prompts: a window of code from a random place in a held-out file.
    r, rng, prompts = ctx.recipe, random.Random(1234), []
    held_ids = tok([d.text for d in held], add_special_tokens=False)["input_ids"]
    usable = [
        i for i, s in enumerate(held_ids) if len(s) > r.eval_prompt_tokens + r.eval_new_tokens
    ]
    for _ in range(r.eval_prompts):
        i = rng.choice(usable)
        start = rng.randrange(0, len(held_ids[i]) - r.eval_prompt_tokens - r.eval_new_tokens)
        prompt = tok.decode(held_ids[i][start : start + r.eval_prompt_tokens])
        prompts.append({"prompt": prompt, "path": held[i].relpath})
    with open(ctx.work_dir / "eval_prompts.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
    return True


def stage_target(ctx: Context) -> bool:
    tok = load_tokenizer(ctx.tokenizer_dir)
    r = ctx.recipe
    # v3: the loss is watched on the validation split (the evaluation split stays unseen)
    kw = {"eval_windows": 256, "spread_eval": True, "eval_name": "validation"} if _v3(ctx) else {}
    held_name = "validation" if _v3(ctx) else "held_out"
    finished = train_target(
        ctx.work_dir / "target_run",
        r.target,
        r.target_train,
        len(tok),
        tok.convert_tokens_to_ids(EOS_TOKEN),
        torch.load(ctx.work_dir / "train_stream.pt"),
        torch.load(ctx.work_dir / f"{held_name}_stream.pt"),
        ctx.device,
        ctx.deadline,
        ctx.log,
        **kw,
    )
    if finished:
        export_target(
            ctx.work_dir / "target_run",
            r.target,
            len(tok),
            tok.convert_tokens_to_ids(EOS_TOKEN),
            ctx.target_dir,
            max_shard_bytes=r.max_shard_bytes,
        )
        result = ctx.work_dir / "target_run" / "result.json"
        if _v3(ctx) and result.is_file():
            ctx.info["target_result"] = json.loads(result.read_text())
        tok.save_pretrained(str(ctx.target_dir))
        ctx.log(
            f"target written to {ctx.target_dir} (mask token id "
            f"{tok.convert_tokens_to_ids(MASK_TOKEN)})"
        )
    return finished


def _train_drafter(
    ctx: Context, method: str, r: DrafterRecipe | None = None, out: Path | None = None
) -> bool:
    """``peagle train`` (the real CLI) for one head; resumes from its output directory.
    ``r`` / ``out``: another head recipe and output directory (the ablation's variants)."""
    import time

    from peagle.cli import main as peagle_main

    r = getattr(ctx.recipe, method) if r is None else r
    out = ctx.work_dir / method if out is None else out
    remaining = ctx.deadline - time.monotonic()
    # Loading the target and data and compiling FlexAttention take up to a minute on CUDA: not
    # worth starting with less left, unless nothing else ran in this call (always progress).
    if remaining <= DRAFTER_MIN_START_S and not ctx.first_stage:
        return False
    if ctx.recipe.regen_prompts > 0:
        data = ["--data", str(ctx.work_dir / "regen.jsonl"), "--jsonl-field", "input_ids"]
    else:
        data = ["--data", str(ctx.work_dir / "train.jsonl")]
    argv = [
        "train",
        "--target", str(ctx.target_dir),
        *data,
        "--output", str(out),
        "--method", method,
        "--num-layers", str(r.num_layers),
        "--intermediate-size", str(r.intermediate_size),
        "--draft-vocab-size", str(ctx.recipe.draft_vocab_size),
        "-k", str(r.k),
        "--cod-r", str(r.cod_r),
        "--cod-r-min", str(r.cod_r_min),
        "--partitions", str(r.partitions),
        "--seq-len", str(r.seq_len),
        "--steps", str(r.steps),
        "--grad-accum", str(r.grad_accum),
        "--pack", str(r.pack),
        "--time-budget", str(r.budget_minutes * 60),
        "--lr", str(r.lr),
        *_switch_flags(r, ctx.recipe),
        "--device", str(ctx.device),
        "--attention", ctx.attention,
        "--save-every", "100",
        "--log-every", "25",
        "--no-progress",
    ]  # fmt: skip
    if remaining != float("inf"):
        # peagle train counts its limit from its start (loading included) and stops before a
        # step that would overrun it; keep a margin for the final save.
        argv += ["--time-limit", str(max(1.0, remaining - 15))]
    ctx.log(f"peagle {' '.join(argv)}")
    rc = peagle_main(argv)
    with open(out / "train_log.jsonl") as f:
        lines = [json.loads(x) for x in f if x.strip()]
    if lines:
        last = lines[-1]
        ctx.log(
            f"{method}: step {last['step']} loss {last['loss']:.4f} acc/depth "
            + " ".join(f"{a:.2f}" for a in last["acc_per_depth"])
            + f" {last['tokens_per_s']:.0f} tok/s"
        )
    return rc == 0


def _switch_flags(r: DrafterRecipe, recipe: Recipe) -> list[str]:
    """The v3 ablation switches and settings as ``peagle train`` flags (none at their defaults,
    so a v2 recipe's command line is unchanged)."""
    out = []
    if r.budget_excludes_startup:
        out.append("--time-budget-excludes-startup")
    if r.warmup_steps != 50:
        out += ["--warmup-steps", str(r.warmup_steps)]
    if r.max_anchors > 0:
        out += ["--max-anchors", str(r.max_anchors)]
    if r.exclude_prompt_loss:
        if recipe.regen_prompts <= 0:
            raise SystemExit("exclude_prompt_loss needs regenerated data (regen_prompts > 0)")
        out += ["--prompt-len-field", "prompt_len"]
    if r.norm_before_residual:
        out.append("--norm-before-residual")
    if r.freeze_lm_head:
        out.append("--freeze-lm-head")
    return out


def drafter_record(work_dir: Path, method: str, r: DrafterRecipe) -> dict:
    """What a trained head saw: settings, steps, tokens, last logged loss/acceptance."""
    from dataclasses import asdict

    out = {"settings": asdict(r)}
    state_path = work_dir / method / "train_state.pt"
    log_path = work_dir / method / "train_log.jsonl"
    if state_path.is_file():
        st = torch.load(state_path, map_location="cpu", weights_only=False)
        out["steps"] = st["step"]
        out["sequences_seen"] = st["position"]
    if log_path.is_file():
        lines = [json.loads(x) for x in log_path.read_text().splitlines() if x.strip()]
        if lines:
            last = lines[-1]
            out["last_log"] = {
                k: last.get(k)
                for k in ("step", "loss", "acc_per_depth", "loss_share_per_depth", "tokens_per_s")
            }
            out["elapsed_s"] = last.get("elapsed_s")
    return out


def stage_regen(ctx: Context) -> bool:
    from default_pair.regen import regenerate

    r = ctx.recipe
    if r.regen_prompts <= 0:
        ctx.log("regen: off (drafters train on the raw training split)")
        return True
    tokens = regenerate(
        ctx.target_dir,
        torch.load(ctx.work_dir / "train_stream.pt"),
        ctx.work_dir / "regen.jsonl",
        num_prompts=r.regen_prompts,
        prompt_tokens=r.regen_prompt_tokens,
        new_tokens=r.regen_new_tokens,
        temperatures=tuple(r.regen_temperatures),
        batch_size=r.regen_batch,
        device=ctx.device,
        log=ctx.log,
        deadline=ctx.deadline,
        budget_s=r.regen_budget_minutes * 60,
        record_prompt_len=_v3(ctx),
    )
    if tokens is None:
        return False
    seqs = tokens // (r.regen_prompt_tokens + r.regen_new_tokens)
    ctx.log(f"regen: {seqs} sequences (of at most {r.regen_prompts}), {tokens} tokens")
    ctx.info.setdefault("corpus", {})["regen_tokens"] = tokens
    return True


def _drafter_stage(ctx: Context, method: str) -> bool:
    finished = _train_drafter(ctx, method)
    if finished and _v3(ctx):
        ctx.info.setdefault("drafters", {})[method] = drafter_record(
            ctx.work_dir, method, getattr(ctx.recipe, method)
        )
    return finished


def stage_peagle(ctx: Context) -> bool:
    return _drafter_stage(ctx, "peagle")


def stage_eagle3(ctx: Context) -> bool:
    return _drafter_stage(ctx, "eagle3")


_SHIPPED_SUFFIXES = (".json", ".safetensors", ".txt")
_NOT_SHIPPED = ("train_state.pt", "train_log.jsonl")


def _copy_model(src: Path, dst: Path) -> int:
    import shutil

    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    total = 0
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix in _SHIPPED_SUFFIXES and f.name not in _NOT_SHIPPED:
            shutil.copy2(f, dst / f.name)
            total += f.stat().st_size
    return total


def stage_package(ctx: Context) -> bool:
    pkg = ctx.package_dir
    pkg.mkdir(parents=True, exist_ok=True)
    sizes = {
        "target": _copy_model(ctx.target_dir, pkg / "target"),
        "peagle": _copy_model(ctx.work_dir / "peagle", pkg / "peagle"),
        "eagle3": _copy_model(ctx.work_dir / "eagle3", pkg / "eagle3"),
    }
    total = sum(sizes.values())
    ctx.log(f"package {pkg}: {sizes} = {total / 2**20:.2f} MiB")
    if total > ctx.recipe.max_package_bytes:
        raise SystemExit(
            f"the pair takes {total} bytes, over the {ctx.recipe.max_package_bytes}-byte budget"
        )
    if ctx.recipe.max_shard_bytes > 0:
        big = [
            (str(f.relative_to(pkg)), f.stat().st_size)
            for f in sorted(pkg.rglob("*"))
            if f.is_file() and f.stat().st_size > ctx.recipe.max_shard_bytes
        ]
        if big:
            raise SystemExit(f"files over {ctx.recipe.max_shard_bytes} bytes: {big}")
    ctx.info["package_bytes"] = sizes
    if _v3(ctx):
        from default_pair import stages_v3

        stages_v3.package_eval_prompts(ctx)
    _write_pair_json(ctx)
    return True


def _write_pair_json(ctx: Context) -> None:
    if _v3(ctx):
        from default_pair import stages_v3

        info = stages_v3.pair_record(ctx)
        text = json.dumps(info, indent=2, sort_keys=True) + "\n"
        (ctx.package_dir / "pair.json").write_text(text)
        return
    info = {
        "python_version": stdlib_corpus.python_version(),
        "corpus": ctx.info.get("corpus", {}),
        "recipe": ctx.recipe.name,
        "package_bytes": ctx.info.get("package_bytes", {}),
        "mask_token": MASK_TOKEN,
        "eos_token": EOS_TOKEN,
    }
    if "results" in ctx.info:
        info["acceptance_length"] = {
            m: {k: v["acceptance_length"] for k, v in res.items()}
            for m, res in ctx.info["results"]["heads"].items()
        }
        info["eval"] = {
            "prompts": ctx.info["results"]["num_prompts"],
            "max_new_tokens": ctx.info["results"]["max_new_tokens"],
            "greedy": True,
        }
    (ctx.package_dir / "pair.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def stage_measure(ctx: Context) -> bool:
    if _v3(ctx):
        from default_pair import stages_v3

        finished = stages_v3.stage_measure(ctx)
        if finished:
            _write_pair_json(ctx)
        return finished
    import time

    from default_pair.measure import acceptance_lengths, load_prompts

    r = ctx.recipe
    prompts = load_prompts(ctx.work_dir / "eval_prompts.jsonl")
    results = {"python_version": stdlib_corpus.python_version(), "recipe": r.name, "heads": {}}
    # Resumable by (head, K): finished Ks go to measure_partial.json (JSON keys are strings).
    partial_path = ctx.work_dir / "measure_partial.json"
    partial = json.loads(partial_path.read_text()) if partial_path.is_file() else {}
    measured_now = []

    def on_result(method, k, res):
        partial.setdefault(method, {})[str(k)] = res
        tmp = partial_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(partial, indent=2))
        tmp.replace(partial_path)
        measured_now.append((method, k))

    def should_stop():
        return time.monotonic() > ctx.deadline

    for method in ("peagle", "eagle3"):
        done = {int(k): v for k, v in partial.get(method, {}).items()}
        if measured_now and len(done) < 10 and should_stop():
            return False
        res = acceptance_lengths(
            ctx.package_dir / "target",
            ctx.package_dir / method,
            method,
            prompts,
            list(range(1, 11)),
            r.eval_new_tokens,
            ctx.device,
            done=done,
            should_stop=should_stop,
            on_result=lambda k, v, m=method: on_result(m, k, v),
        )
        if res is None:
            ctx.log(f"measure: paused ({len(partial.get(method, {}))}/10 Ks of {method} done)")
            return False
        results["heads"][method] = res
        ctx.log(
            f"{method} acceptance length per K: "
            + " ".join(f"K={k}:{v['acceptance_length']:.2f}" for k, v in res.items())
        )
    results["num_prompts"] = len(prompts)
    results["max_new_tokens"] = r.eval_new_tokens
    (ctx.work_dir / "results.json").write_text(json.dumps(results, indent=2))
    ctx.info["results"] = results
    _write_pair_json(ctx)
    return True


def stage_report(ctx: Context) -> bool:
    from default_pair.report import write_report

    path = write_report(ctx)
    ctx.log(f"report written to {path}")
    return True


STAGES = [
    Stage("tokenizer", stage_tokenizer),
    Stage("tokenize", stage_tokenize),
    Stage("target", stage_target),
    Stage("regen", stage_regen),
    Stage("peagle", stage_peagle),
    Stage("eagle3", stage_eagle3),
    Stage("package", stage_package),
    Stage("measure", stage_measure),
    Stage("report", stage_report),
]
