#!/usr/bin/env python3
"""Reproduce peagle's packaged default model pair: a small Llama code model trained from scratch on
the running interpreter's standard library, its P-EAGLE drafter and an EAGLE-3 head.

Stages (each resumable; the state lives in --work-dir):
  1. tokenizer  byte-level BPE on the training split of the stdlib sources (tokenizers)
  2. tokenize   token streams of the training and held-out splits, held-out evaluation prompts
  3. target     the Llama model, trained from scratch (plain causal LM)
  4. regen      self-distillation data: the target continues training-split prompts
  5. peagle     its P-EAGLE drafter, trained with `peagle train --method peagle`
  6. eagle3     an autoregressive EAGLE-3 head, `peagle train --method eagle3`
  7. package    copy the pair (bf16) into --package-dir, check the 16 MiB budget
  8. measure    held-out acceptance lengths per K = 1..10 (greedy) for both heads
  9. report     docs/default-model-pair-<recipe>.md

Each invocation works until --max-minutes have passed, saves, and exits with status 75 when work
is left ("run me again"), 0 when every stage is done. On one H200 (work dir under build/ so it
survives between calls on a warm machine; repeat until it exits 0):

  python scripts/train_default_pair.py --device cuda --work-dir build/pair-v3 --max-minutes 9

--device cuda runs recipe v3 (gpu-v3, issue 19: corpus = every installed Python source split by
distribution, a 24-layer target, 4-layer P-EAGLE and 1-layer EAGLE-3 heads, HumanEval next to
the held-out packages; docs/default-model-pair.md); the shipped pair is v2: --recipe gpu-v2.
tools/h200.sh pair wraps it for the H200 machine (calls under 9.5 minutes, the bundle in $OUT).

The CPU recipe produced the pair that ships in the package (about an hour on 2 cores):

  python scripts/train_default_pair.py --device cpu --work-dir /tmp/pair-cpu --threads 1

On a machine with two GPUs the two heads can train at once (--only runs one stage whose
predecessors are done; each process records its stage in the shared work dir; S is this script):

  python S --device cuda --work-dir W --until regen
  CUDA_VISIBLE_DEVICES=0 python S --device cuda --work-dir W --only peagle &
  CUDA_VISIBLE_DEVICES=1 python S --device cuda --work-dir W --only eagle3; wait
  python S --device cuda --work-dir W                  # package, measure, report
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from default_pair import stdlib_corpus  # noqa: E402
from default_pair.recipes import (  # noqa: E402
    H200_CALL_S,
    RECIPES,
    apply_drafter_settings,
    estimate_minutes,
    estimate_package_bytes,
    format_calls,
    simulate_calls,
)
from default_pair.stages import STAGES, Context  # noqa: E402

EXIT_MORE_WORK = 75


def print_plan(recipe, args) -> int:
    """The --dry-run output; returns 2 when the pair would not fit the package budget."""
    done_path = args.work_dir / "done.json"
    done = json.loads(done_path.read_text()) if done_path.is_file() else {}
    plan = estimate_minutes(recipe)
    print(f"recipe {recipe.name} (device {args.device}); estimated minutes on one H200:")
    for name, what, minutes in plan:
        mark = "done" if all(done.get(s, {}).get("done") for s in name.split("+")) else ""
        print(f"  {name:<19} {minutes:5.1f}  {mark:<4}  {what}")
    total = sum(m for _, _, m in plan)
    left = sum(m for n, _, m in plan if not all(done.get(s, {}).get("done") for s in n.split("+")))
    print(f"  {'total':<19} {total:5.1f}        ({left:.1f} left in {args.work_dir})")
    if args.device == "cuda":
        # tools/h200.sh pair: calls of CALL_SECONDS (555 s), build in the first, by the script's
        # own rules (stages resume across calls; a head does not start with < 90 s left and
        # pays its load + compile again when cut)
        items = []
        for name, _, minutes in plan:
            if all(done.get(s, {}).get("done") for s in name.split("+")):
                continue
            rule = "head" if name in ("peagle", "eagle3") else "split"
            items.append((name, minutes * 60, rule))
        calls = simulate_calls(items)
        for line in format_calls(calls):
            print("  " + line)
        run_s = sum(x for c in calls for _, x in c)
        print(
            f"tools/h200.sh pair: ~{run_s / 60:.1f} H200 minutes of run time in {len(calls)} "
            f"call(s) of <= {H200_CALL_S / 60:.2f} min (build and per-call start-up included; "
            "the machine's ~3-minute start not included)"
        )
    elif args.max_minutes > 0:
        calls = max(1, math.ceil(left / args.max_minutes))
        print(
            f"chunks of --max-minutes {args.max_minutes:g}: about {calls} call(s) "
            "(each also pays ~0.3 min of start-up, and a drafter stage its load + compile)"
        )
    sizes = estimate_package_bytes(recipe)
    total_b = sum(sizes.values())
    print(
        "package (bf16): "
        + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sizes.items())
        + f"; total {total_b / 2**20:.2f} of {recipe.max_package_bytes / 2**20:.0f} MiB"
    )
    print(
        f"held-out evaluation: {recipe.eval_prompts} prompts x {recipe.eval_prompt_tokens} "
        f"tokens, {recipe.eval_new_tokens} new tokens, greedy, K = 1..10"
    )
    return 0 if total_b <= recipe.max_package_bytes else 2


def _save_done(path: Path, done: dict) -> None:
    """Merges ``done`` into the file (stages another process finished meanwhile are kept) and
    back into ``done``; written by atomic rename."""
    on_disk = json.loads(path.read_text()) if path.is_file() else {}
    on_disk.update(done)
    done.clear()
    done.update(on_disk)
    tmp = path.with_suffix(f".tmp{id(done)}")
    tmp.write_text(json.dumps(done, indent=2, sort_keys=True))
    tmp.replace(path)


def quiet_hf_progress() -> None:
    """transformers' "Loading weights" / "Writing model shards" bars only on a terminal (a GPU
    run's log is a file)."""
    if not sys.stderr.isatty():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda (selects the recipe too)")
    ap.add_argument("--recipe", choices=sorted(RECIPES), help="default: the device's recipe")
    ap.add_argument("--work-dir", type=Path, required=True, help="resumable state and logs")
    ap.add_argument(
        "--package-dir",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "python" / "peagle" / "default_models",
        help="where the finished pair is written (default: the package's default_models/)",
    )
    ap.add_argument("--max-minutes", type=float, default=0.0, help="stop after this (0 = no limit)")
    ap.add_argument("--until", choices=[s.name for s in STAGES], help="stop after this stage")
    ap.add_argument(
        "--only",
        choices=[s.name for s in STAGES],
        help="run this one stage (every earlier stage must be done; another process may run "
        "a different stage in the same work dir, e.g. the other head on a second GPU)",
    )
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch default)")
    ap.add_argument(
        "--attention",
        default="auto",
        choices=("auto", "flex", "dense", "chunked"),
        help="peagle train's mask kernel (auto: FlexAttention on CUDA, chunked SDPA on CPU)",
    )
    v3 = ap.add_argument_group("recipe v3 (corpus 'site')")
    v3.add_argument(
        "--corpus-path",
        action="append",
        help="look for installed distributions here instead of sys.path (repeatable; tests)",
    )
    v3.add_argument("--stdlib-root", type=Path, help="the standard library directory (tests)")
    v3.add_argument("--no-stdlib", action="store_true", help="leave the stdlib out (tests)")
    v3.add_argument(
        "--drafter-settings",
        type=Path,
        help='JSON {"peagle": {field: value}, "eagle3": {...}} overriding the heads\' recipe '
        "fields (the ablation's choice.json)",
    )
    v3.add_argument(
        "--bundle",
        type=Path,
        help="once every stage is done, lay the pair and its records out in this directory as "
        "at most 8 files of at most 16 MiB (a GPU run's $OUT; default_pair/bundle.py unpacks)",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="print the recipe's plan (stages, settings, estimated H200 minutes, package size) "
        "and the chunks --max-minutes gives; touch nothing, need no GPU",
    )
    args = ap.parse_args(argv)
    quiet_hf_progress()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    recipe = RECIPES[args.recipe or ("gpu" if device.type == "cuda" else "cpu")]
    if args.drafter_settings is not None:
        recipe = apply_drafter_settings(recipe, json.loads(args.drafter_settings.read_text()))
    if args.dry_run:
        return print_plan(recipe, args)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    deadline = start + args.max_minutes * 60 if args.max_minutes > 0 else float("inf")
    log_path = args.work_dir / "log.txt"

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - start:7.1f}s] {msg}"
        print(line, flush=True)
        with open(log_path, "a") as f:
            f.write(line + "\n")

    done_path = args.work_dir / "done.json"
    done = json.loads(done_path.read_text()) if done_path.is_file() else {}
    ctx = Context(
        work_dir=args.work_dir,
        package_dir=args.package_dir,
        recipe=recipe,
        device=device,
        deadline=deadline,
        log=log,
        info=done,
        attention=args.attention,
        corpus_paths=args.corpus_path,
        stdlib_root=args.stdlib_root,
        include_stdlib=not args.no_stdlib,
    )
    log(f"recipe {recipe.name}, device {device}, Python {stdlib_corpus.python_version()}")
    sizes = estimate_package_bytes(recipe)
    if sum(sizes.values()) > recipe.max_package_bytes:
        log(f"recipe {recipe.name} would take {sizes} bytes, over {recipe.max_package_bytes}")
        return 2
    names = [s.name for s in STAGES]
    if args.only:
        missing = [n for n in names[: names.index(args.only)] if not done.get(n, {}).get("done")]
        # the heads are independent of each other: eagle3 needs regen, not peagle
        if args.only == "eagle3" and missing == ["peagle"]:
            missing = []
        if missing:
            log(f"--only {args.only}: earlier stages not done: {', '.join(missing)}")
            return 2
    for stage in STAGES:
        if args.until and names.index(stage.name) > names.index(args.until):
            log(f"stages up to {args.until} done (--until)")
            return 0
        if done.get(stage.name, {}).get("done"):
            continue
        if args.only and stage.name != args.only:
            continue
        log(f"stage {stage.name}")
        finished = stage.run(ctx)
        if not finished:
            log(f"stage {stage.name} not finished; run again to continue")
            return EXIT_MORE_WORK
        ctx.first_stage = False
        done.setdefault(stage.name, {})["done"] = True
        _save_done(done_path, done)
        if args.only:
            log(f"stage {stage.name} done (--only)")
            return 0
        if args.until == stage.name:
            log(f"stopping after stage {stage.name} (--until)")
            return 0
        if time.monotonic() > deadline:
            log("time limit reached between stages; run again to continue")
            return EXIT_MORE_WORK
    log("all stages done")
    if args.bundle is not None:
        from default_pair.bundle import pack

        files = pack(args.package_dir, args.work_dir, args.bundle, recipe)
        log(f"bundle: {len(files)} files in {args.bundle}: {', '.join(f.name for f in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
