#!/usr/bin/env python3
"""The head-training ablation of recipe v3 (issue 19): reduced-scale variants, picked by
*validation* acceptance (the evaluation split and HumanEval are never looked at here). Sized to
fit ONE H200 reservation with its target and data (``--dry-run`` prints the plan per call).

1. The recipe's stages up to ``regen`` run in --work-dir (recipe ``gpu-v3-ablate`` by default: the
   v3 corpus split, tokenizer and shapes; a 2.5-minute target on a 128 MB subset of the training
   split and 0.5 minutes of regeneration).
2. Each variant -- one switch changed from the baseline head, one factor at a time -- trains with
   ``peagle train`` for --variant-minutes *after its first step* (loading and the first step's
   compilation excluded, so the variant that compiles in a call trains as long as the others)
   into ``<work-dir>/ablate/<variant>/`` and is measured on the validation prompts (greedy, the
   recipe's new tokens, K in --ks): ``result.json`` (with per-prompt counts). A variant starts
   only when its estimated time (the slowest of this call so far, else the plan's) fits before
   the deadline; otherwise the call ends with 75 and the next one continues.
3. ``ablation.json`` / ``ablation.md`` (the table: validation AL per K, depth-0 loss share, gain
   over the baseline with a paired bootstrap standard error) and ``choice.json`` are rewritten
   after every variant: for each switch the value with the highest validation AL at K = --pick-k,
   a non-baseline value only when its gain over the baseline exceeds both --min-gain and twice
   the gain's standard error (the noise guard). ``train_default_pair.py --drafter-settings
   choice.json`` (``tools/h200.sh pair --drafter-settings ...``) trains the final heads with it.

Resumable like the recipe (exit 75: run again; 0: done). Several GPUs: ``--lanes N --lane i``
runs every N-th variant (one process per GPU, CUDA_VISIBLE_DEVICES=i), then a call without
--lane (or with --summarize) writes the table. Every variant of one work dir shares its target
and data, so variants compare like with like; a new reservation (a fresh work dir) must rerun
``*-base`` with the variants it compares.

  python scripts/ablate_default_pair.py --device cuda --work-dir build/ablate --dry-run
  python scripts/ablate_default_pair.py --device cuda --work-dir build/ablate --max-minutes 8.8
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_default_pair as recipe_script  # noqa: E402
from default_pair import recipes as rc  # noqa: E402
from default_pair.recipes import RECIPES, Recipe  # noqa: E402
from default_pair.stages import Context, _train_drafter, drafter_record  # noqa: E402

EXIT_MORE_WORK = 75
BOOTSTRAP_SAMPLES = 2000


@dataclass(frozen=True)
class Variant:
    name: str
    method: str
    group: str  # the switch it varies ("base" for the baseline)
    overrides: dict = field(default_factory=dict)


def _variants() -> list[Variant]:
    """One factor at a time from each head's baseline (recipe v3's head settings). P-EAGLE: every
    switch of issue 19 with one alternative value; EAGLE-3 (the competitor, tuned likewise): the
    switches that apply to a serial head (no chain-start cap or COD rates: its TTT passes are
    its depth). 11 variants: what one reservation holds next to the target and the data."""
    out = []
    for m in ("peagle", "eagle3"):
        out.append(Variant(f"{m}-base", m, "base"))
        out.append(
            Variant(f"{m}-no-prompt-loss", m, "exclude_prompt_loss", {"exclude_prompt_loss": True})
        )
        out.append(Variant(f"{m}-frozen-lm-head", m, "freeze_lm_head", {"freeze_lm_head": True}))
        out.append(
            Variant(f"{m}-norm-before-residual", m, "norm_before_residual",
                    {"norm_before_residual": True})
        )  # fmt: skip
        if m == "peagle":
            out += [
                # at most 16 chains start per 192-token sequence: most of the loss on depth 0
                Variant("peagle-anchors-16", m, "max_anchors", {"max_anchors": 16}),
                Variant("peagle-cod-0.8-0.3", m, "cod", {"cod_r": 0.8, "cod_r_min": 0.3}),
                Variant("peagle-k7", m, "k", {"k": 7}),
            ]
    # peagle first (the head the goals are about), baselines first within each head
    return sorted(out, key=lambda v: (v.method != "peagle", v.group != "base"))


VARIANTS = _variants()


def _al(pairs: list[list[int]], idx: list[int] | range) -> float:
    steps = sum(pairs[i][0] for i in idx)
    return 1.0 + sum(pairs[i][1] for i in idx) / max(1, steps)


def gain_se(base: dict, res: dict, k: int, samples: int = BOOTSTRAP_SAMPLES) -> float:
    """Standard error of ``AL(res) - AL(base)`` at ``k`` by a paired bootstrap over the prompts
    (both measured on the same prompts, in order; AL pooled as in the measurement); 0.0 when the
    per-prompt counts are missing."""
    a = base["validation"].get(str(k), {}).get("per_prompt")
    b = res["validation"].get(str(k), {}).get("per_prompt")
    if not a or not b or len(a) != len(b):
        return 0.0
    rng = random.Random(0)
    n = len(a)
    diffs = []
    for _ in range(samples):
        idx = [rng.randrange(n) for _ in range(n)]
        diffs.append(_al(b, idx) - _al(a, idx))
    mean = sum(diffs) / samples
    return (sum((d - mean) ** 2 for d in diffs) / (samples - 1)) ** 0.5


def _al_at(res: dict, k: int) -> float:
    return res["validation"][str(k)]["acceptance_length"]


def pick(results: dict[str, dict], pick_k: int, min_gain: float) -> dict:
    """``{"peagle": {field: value}, "eagle3": {...}}``: per head and switch, the overrides of the
    variant with the best validation AL at ``pick_k`` if its gain over the baseline exceeds
    ``min_gain`` and twice its paired standard error. Variants without a result at ``pick_k``
    (not run yet, or a P-EAGLE head trained shallower, measured at K <= its depth only) are left
    out; a head without a baseline result at ``pick_k`` gets none."""
    choice: dict[str, dict] = {}
    by_name = {v.name: v for v in VARIANTS}
    for method in ("peagle", "eagle3"):
        base = results.get(f"{method}-base")
        if base is None or str(pick_k) not in base["validation"]:
            continue
        base_al = _al_at(base, pick_k)
        chosen: dict = {}
        groups: dict[str, list[tuple[float, Variant]]] = {}
        for name, res in results.items():
            v = by_name.get(name)
            if v is None or v.method != method or v.group == "base":
                continue
            if str(pick_k) in res["validation"]:
                groups.setdefault(v.group, []).append((_al_at(res, pick_k), v))
        for _, cands in sorted(groups.items()):
            al, v = max(cands, key=lambda x: x[0])
            if al - base_al > max(min_gain, 2 * gain_se(base, results[v.name], pick_k)):
                chosen.update(v.overrides)
        choice[method] = chosen
    return choice


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or x != x else format(x, spec)


def _table(results: dict[str, dict], ks: list[int], pick_k: int, choice: dict, meta: dict) -> str:
    lines = [
        "# Recipe v3 head ablation (validation acceptance; generated by "
        "scripts/ablate_default_pair.py)",
        "",
        f"Recipe `{meta.get('recipe')}`; {meta.get('variant_minutes')} min of training per "
        f"variant after its first step; {meta.get('validation_prompts')} validation prompts x "
        f"{meta.get('new_tokens')} greedy tokens. Picked by validation AL at K = {pick_k}: a "
        f"switch is taken when its gain over the baseline exceeds {meta.get('min_gain')} and "
        "twice its paired-bootstrap standard error. Chosen settings: "
        f"`{json.dumps(choice)}`.",
        "",
        "| variant | changes | train s | steps | tokens seen | final KL | depth-0 loss share | "
        "acc0 | " + " | ".join(f"AL K={k}" for k in ks) + f" | gain at K={pick_k} (± SE) |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(ks) + "---|",
    ]
    for v in VARIANTS:
        res = results.get(v.name)
        if res is None:
            continue
        rec = res["train"]
        last = rec.get("last_log") or {}
        share = (last.get("loss_share_per_depth") or [None])[0]
        acc0 = (last.get("acc_per_depth") or [None])[0]
        als = " | ".join(
            _fmt(_al_at(res, k), ".3f") if str(k) in res["validation"] else "-" for k in ks
        )
        base = results.get(f"{v.method}-base")
        gain = "-"
        if v.group != "base" and base is not None and str(pick_k) in res["validation"]:
            d = _al_at(res, pick_k) - _al_at(base, pick_k)
            gain = f"{d:+.3f} ± {gain_se(base, res, pick_k):.3f}"
        seen = rec.get("tokens_seen")
        lines.append(
            f"| {v.name} | {json.dumps(v.overrides) if v.overrides else 'baseline'} | "
            f"{_fmt(rec.get('elapsed_s'), '.0f')} | {rec.get('steps')} | "
            f"{_fmt(seen / 1e6 if seen else None, '.2f')} M | {_fmt(last.get('loss'), '.4f')} | "
            f"{_fmt(share, '.2f')} | {_fmt(acc0, '.3f')} | {als} | {gain} |"
        )
    return "\n".join(lines) + "\n"


def summarize(
    work_dir: Path, ks: list[int], pick_k: int, min_gain: float, meta: dict | None = None
) -> dict:
    results = {}
    for v in VARIANTS:
        f = work_dir / "ablate" / v.name / "result.json"
        if f.is_file():
            results[v.name] = json.loads(f.read_text())
    choice = pick(results, pick_k, min_gain)
    meta = {"min_gain": min_gain, **(meta or {})}
    slim = {}
    for name, res in results.items():
        base = results.get(f"{res['variant']['method']}-base")
        slim[name] = {
            **{k: v for k, v in res.items() if k != "validation"},
            "validation": {
                k: {kk: vv for kk, vv in r.items() if kk != "per_prompt"}
                for k, r in res["validation"].items()
            },
            f"gain_se_at_{pick_k}": None if base is None else gain_se(base, res, pick_k),
        }
    (work_dir / "ablation.json").write_text(
        json.dumps({"results": slim, "choice": choice, "pick_k": pick_k, **meta}, indent=1) + "\n"
    )
    (work_dir / "choice.json").write_text(json.dumps(choice, indent=1) + "\n")
    (work_dir / "ablation.md").write_text(_table(results, ks, pick_k, choice, meta))
    return choice


# -- the plan (--dry-run) ---------------------------------------------------------------------


def variant_seconds(recipe: Recipe, v: Variant, minutes: float, ks: list[int]) -> float:
    """Estimated wall seconds of one variant on one H200, without the first-of-call compile:
    load, training budget, final save, validation measurement."""
    head = replace(getattr(recipe, v.method), **v.overrides)
    steps = sum(recipe.eval_new_tokens / 2.0 for k in ks if v.method == "eagle3" or k <= head.k)
    step_s = rc.ENGINE_STEP_S_V3
    if v.method == "eagle3":
        step_s += rc.EAGLE3_DRAFT_PASS_S * (sum(ks) / max(1, len(ks)))
    calls = -(-recipe.validation_prompts // recipe.measure_batch)
    measure = rc.MEASURE_LOAD_S + calls * steps * step_s
    return rc.VARIANT_LOAD_S + minutes * 60 + rc.VARIANT_SAVE_S + measure


def plan(
    recipe: Recipe, variants: list[Variant], minutes: float, ks: list[int]
) -> tuple[list[list[tuple[str, float]]], list[tuple[str, str, float]]]:
    """``(calls, shared)``: the H200 calls of ``tools/h200.sh ablate`` on one GPU as lists of
    ``(item, seconds)`` (:func:`default_pair.recipes.simulate_calls`: stages resume across calls,
    a variant starts only when it fits before the deadline, the first variant of a call pays the
    compile), and the shared stages' plan ``[(stage, what, minutes)]`` from the recipe."""
    shared = [p for p in rc.estimate_minutes(recipe) if p[0] in ("tokenizer+tokenize", "target",
                                                                  "regen")]  # fmt: skip
    items = [(name, m * 60, "split") for name, _, m in shared]
    items += [(v.name, variant_seconds(recipe, v, minutes, ks), "variant") for v in variants]
    items.append(("summary", 1.0, "split"))
    return rc.simulate_calls(items), shared


def print_plan(args, recipe: Recipe, variants: list[Variant]) -> int:
    calls, shared = plan(recipe, variants, args.variant_minutes, args.ks)
    print(
        f"ablation of recipe {recipe.name}: {len(variants)} variants x {args.variant_minutes:g} "
        f"min of training after the first step, scored by validation AL at K = {args.ks} "
        f"({recipe.validation_prompts} prompts x {recipe.eval_new_tokens} tokens)"
    )
    print("shared stages (estimated minutes on one H200):")
    for name, what, m in shared:
        print(f"  {name:<19} {m:5.1f}  {what}")
    total = sum(x for c in calls for _, x in c)
    for line in rc.format_calls(calls):
        print(line)
    print(
        f"total: {total / 60:.1f} H200 minutes of run time in {len(calls)} call(s) of at most "
        f"{rc.H200_CALL_S / 60:.2f} min (build included; the machine's start, ~3 min, and "
        "transfers not included; one GPU: --lanes N on N GPUs shortens the variants' calls)"
    )
    print(
        "timing constants: measured on the H200 by the first ablation run (2026-12-02) -- the "
        "build, the corpus, BPE and encode rates, the target's and the heads' throughput, "
        "regeneration, the compile and a variant's load; estimates -- CALL_START_S, "
        "VARIANT_SAVE_S, MEASURE_LOAD_S, ENGINE_STEP_S_V3 "
        "(scripts/default_pair/recipes.py); the target, regeneration and each variant stop at "
        "their budgets, so only the fixed costs can move the total"
    )
    return 0 if len(calls) <= args.max_calls else 2


# -- the driver -------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--recipe", default="gpu-v3-ablate", choices=sorted(RECIPES))
    ap.add_argument("--work-dir", type=Path, required=True)
    ap.add_argument("--max-minutes", type=float, default=0.0, help="0 = no limit")
    ap.add_argument(
        "--variant-minutes",
        type=float,
        default=0.75,
        help="each head's training time after its first step (default: %(default)s)",
    )
    ap.add_argument("--variants", nargs="+", help="names (default: all, in order)")
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 5, 7])
    ap.add_argument("--pick-k", type=int, default=7)
    ap.add_argument("--min-gain", type=float, default=0.02, help="AL a switch must add")
    ap.add_argument("--lanes", type=int, default=1)
    ap.add_argument("--lane", type=int, help="run variants i with i %% lanes == lane only")
    ap.add_argument("--summarize", action="store_true", help="only write the table")
    ap.add_argument(
        "--prepare-only", action="store_true", help="run the shared stages (before --lane calls)"
    )
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--corpus-path", action="append", help="(tests) see train_default_pair.py")
    ap.add_argument("--stdlib-root", type=Path, help="(tests)")
    ap.add_argument("--list", action="store_true", help="print the variants and exit")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan: shared stages and the H200 calls (estimated minutes); touch nothing",
    )
    ap.add_argument(
        "--max-calls", type=int, default=3, help="--dry-run exits 2 when the plan needs more"
    )
    args = ap.parse_args(argv)
    recipe_script.quiet_hf_progress()
    if args.list:
        for v in VARIANTS:
            print(f"{v.name:<28} {v.method:<7} {v.group:<22} {json.dumps(v.overrides)}")
        return 0
    if args.pick_k not in args.ks:
        ap.error("--pick-k must be one of --ks")
    names = {v.name for v in VARIANTS}
    for n in args.variants or []:
        if n not in names:
            ap.error(f"unknown variant {n!r} (--list)")
    recipe = RECIPES[args.recipe]
    todo = [v for v in VARIANTS if not args.variants or v.name in args.variants]
    if args.dry_run:
        return print_plan(args, recipe, todo)
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = {
        "recipe": args.recipe,
        "variant_minutes": args.variant_minutes,
        "validation_prompts": recipe.validation_prompts,
        "new_tokens": recipe.eval_new_tokens,
    }
    if args.summarize:
        print(json.dumps(summarize(args.work_dir, args.ks, args.pick_k, args.min_gain, meta)))
        return 0
    start = time.monotonic()
    deadline = start + args.max_minutes * 60 if args.max_minutes > 0 else float("inf")
    done_path = args.work_dir / "done.json"

    def shared_done() -> bool:
        return done_path.is_file() and bool(
            json.loads(done_path.read_text()).get("regen", {}).get("done")
        )

    # 1. the shared target and data (the recipe's own resumable stages)
    pre = ["--device", args.device, "--recipe", args.recipe, "--work-dir", str(args.work_dir)]
    pre += ["--until", "regen", "--package-dir", str(args.work_dir / "unused-package")]
    if args.max_minutes > 0:
        pre += ["--max-minutes", str(args.max_minutes)]
    if args.threads:
        pre += ["--threads", str(args.threads)]
    for p in args.corpus_path or []:
        pre += ["--corpus-path", p]
    if args.stdlib_root:
        pre += ["--stdlib-root", str(args.stdlib_root)]
    ran_shared = False
    if args.lane is None:
        ran_shared = not shared_done()
        code = recipe_script.main(pre)
        if code != 0 or args.prepare_only:
            return code
    elif not shared_done():
        print("--lane: run the shared stages first (a call without --lane)", file=sys.stderr)
        return 2
    log_path = args.work_dir / "log.txt"

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - start:7.1f}s] ablate: {msg}"
        print(line, flush=True)
        with open(log_path, "a") as f:
            f.write(line + "\n")

    ctx = Context(
        work_dir=args.work_dir,
        package_dir=args.work_dir / "unused-package",
        recipe=recipe,
        device=torch.device(args.device),
        deadline=deadline,
        log=log,
        info={},
        # a variant always starts in a call that did nothing else (progress in every call)
        first_stage=not ran_shared,
    )
    if args.lane is not None:
        todo = [v for i, v in enumerate(todo) if i % args.lanes == args.lane]
    prompts = _validation_prompts(args.work_dir)
    slowest = 0.0  # the slowest variant of this call (wall seconds), the next one's estimate
    ran = 0
    for v in todo:
        out = args.work_dir / "ablate" / v.name
        if (out / "result.json").is_file():
            continue
        est = max(slowest, variant_seconds(recipe, v, args.variant_minutes, args.ks))
        if ran == 0:
            est += rc.DRAFTER_COMPILE_S
        if not ctx.first_stage and time.monotonic() + est > deadline:
            log(f"time limit: {v.name} (~{est:.0f} s) does not fit; run again to continue")
            return EXIT_MORE_WORK
        head = replace(
            getattr(recipe, v.method),
            **v.overrides,
            budget_minutes=args.variant_minutes,
            budget_excludes_startup=True,
        )
        log(f"variant {v.name}: {json.dumps(v.overrides) if v.overrides else 'baseline'}")
        t_v = time.monotonic()
        if not _train_drafter(ctx, v.method, r=head, out=out):
            log(f"variant {v.name}: training not finished; run again to continue")
            return EXIT_MORE_WORK
        t_trained = time.monotonic()
        ctx.first_stage = False
        from default_pair.measure import acceptance_lengths

        ks = [k for k in args.ks if k <= head.k] if v.method == "peagle" else list(args.ks)
        res = acceptance_lengths(
            args.work_dir / "target", out, v.method, [], ks, recipe.eval_new_tokens,
            ctx.device, max_num_seqs=recipe.measure_batch, prompt_ids=prompts, per_prompt=True,
        )  # fmt: skip
        t_end = time.monotonic()
        train = drafter_record(args.work_dir / "ablate", v.name, head)
        if train.get("sequences_seen") is not None:
            seq_tokens = recipe.regen_prompt_tokens + recipe.regen_new_tokens
            train["tokens_seen"] = train["sequences_seen"] * seq_tokens
        result = {
            "variant": asdict(v),
            "train": train,
            "validation": {str(k): r for k, r in res.items()},
            "validation_prompts": len(prompts),
            "wall_s": {"train": t_trained - t_v, "measure": t_end - t_trained},
        }
        (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
        slowest = max(slowest, t_end - t_v)
        ran += 1
        log(
            f"variant {v.name}: validation AL "
            + " ".join(f"K={k}:{r['acceptance_length']:.3f}" for k, r in res.items())
            + f" (train {t_trained - t_v:.0f} s incl. load, measure {t_end - t_trained:.0f} s)"
        )
        if args.lane is None:
            summarize(args.work_dir, args.ks, args.pick_k, args.min_gain, meta)
    if args.lane is None:
        choice = summarize(args.work_dir, args.ks, args.pick_k, args.min_gain, meta)
        log(f"done; choice {json.dumps(choice)} (table in {args.work_dir / 'ablation.md'})")
    return 0


def _validation_prompts(work_dir: Path) -> list[list[int]]:
    path = work_dir / "validation_prompts.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: the recipe needs validation_prompts > 0")
    with open(path) as f:
        return [json.loads(line)["token_ids"] for line in f if line.strip()]


if __name__ == "__main__":
    sys.exit(main())
