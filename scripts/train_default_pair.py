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
survives between calls on a warm machine; repeat until it exits 0, ~15-20 minutes in total):

  python scripts/train_default_pair.py --device cuda --work-dir build/pair-gpu --max-minutes 8.5

The CPU recipe produced the pair that ships in the package (about an hour on 2 cores):

  python scripts/train_default_pair.py --device cpu --work-dir /tmp/pair-cpu --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from default_pair import stdlib_corpus  # noqa: E402
from default_pair.recipes import RECIPES, estimate_package_bytes  # noqa: E402
from default_pair.stages import STAGES, Context  # noqa: E402

EXIT_MORE_WORK = 75


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
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch default)")
    ap.add_argument(
        "--attention",
        default="auto",
        choices=("auto", "flex", "dense", "chunked"),
        help="peagle train's mask kernel (auto: FlexAttention on CUDA, chunked SDPA on CPU)",
    )
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    recipe = RECIPES[args.recipe or ("gpu" if device.type == "cuda" else "cpu")]
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
    )
    log(f"recipe {recipe.name}, device {device}, Python {stdlib_corpus.python_version()}")
    sizes = estimate_package_bytes(recipe)
    if sum(sizes.values()) > recipe.max_package_bytes:
        log(f"recipe {recipe.name} would take {sizes} bytes, over {recipe.max_package_bytes}")
        return 2
    for stage in STAGES:
        if done.get(stage.name, {}).get("done"):
            continue
        log(f"stage {stage.name}")
        finished = stage.run(ctx)
        if not finished:
            log(f"stage {stage.name} not finished; run again to continue")
            return EXIT_MORE_WORK
        done.setdefault(stage.name, {})["done"] = True
        done_path.write_text(json.dumps(done, indent=2, sort_keys=True))
        if args.until == stage.name:
            log(f"stopping after stage {stage.name} (--until)")
            return 0
        if time.monotonic() > deadline:
            log("time limit reached between stages; run again to continue")
            return EXIT_MORE_WORK
    log("all stages done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
