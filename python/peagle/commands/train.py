"""``peagle train``: train a P-EAGLE drafter or an EAGLE-3 head for a Hugging Face target."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from peagle.errors import (
    HUB_UNREACHABLE,
    UserError,
    check_device,
    check_model_location,
    first_line,
    go_offline_if_hub_unreachable,
)

DESCRIPTION = """\
Train a P-EAGLE (parallel) drafter or an autoregressive EAGLE-3 head for a target model
(a Hugging Face Llama-family checkpoint directory, loaded with transformers). Target features of
the 3 auxiliary layers and the target distribution are computed online; each sequence is
expanded into the NxK layout with COD sampling, trained with the P-EAGLE attention mask
(FlexAttention on CUDA, chunked SDPA on CPU) and optional sequence partitioning, against the
target's soft labels (KL(target||draft)). The output directory holds the drafter in the released
checkpoint format (config.json + model.safetensors), loadable by `peagle generate` and vLLM, and
the resumable training state: run the same command again to continue."""

EPILOG = """\
example (P-EAGLE drafter, K=8, 2 sequence partitions, 32k-token draft vocabulary):
  peagle train --target ./Llama-3.2-1B --data corpus.jsonl --output ./llama-1b-p-eagle \\
      --method peagle -k 8 --partitions 2 --num-layers 4 --draft-vocab-size 32000 \\
      --seq-len 2048 --steps 20000 --lr 6e-4

  peagle train --target ./Llama-3.2-1B --data ./texts/ --data-glob '*.txt' \\
      --output ./llama-1b-eagle3 --method eagle3 -k 7 --num-layers 1 --steps 20000
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train",
        help="train a P-EAGLE drafter or an EAGLE-3 head",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    io = p.add_argument_group("models and data")
    io.add_argument("--target", required=True, help="target model directory (transformers)")
    io.add_argument("--tokenizer", help="tokenizer directory (default: --target)")
    io.add_argument(
        "--data",
        nargs="+",
        required=True,
        help="text files, directories (searched recursively, see --data-glob) or *.jsonl files "
        "(one document per line in --jsonl-field)",
    )
    io.add_argument("--data-glob", default="*", help="file pattern inside directories (default: *)")
    io.add_argument(
        "--jsonl-field",
        default="text",
        help="JSONL field with the document text (default: %(default)s)",
    )
    io.add_argument("--output", required=True, help="output (and resume) directory")
    d = p.add_argument_group("drafter")
    d.add_argument(
        "--method",
        choices=("peagle", "eagle3"),
        default="peagle",
        help="peagle: parallel drafter with mask token and mask_hidden; eagle3: "
        "autoregressive head trained with test-time training (default: %(default)s)",
    )
    d.add_argument("--num-layers", type=int, help="decoder layers (default: 4 peagle, 1 eagle3)")
    d.add_argument("--intermediate-size", type=int, help="MLP width (default: the target's)")
    d.add_argument(
        "--draft-vocab-size",
        type=int,
        help="keep the N most frequent target tokens of the corpus as the draft "
        "vocabulary (writes d2t/t2d; default: the full vocabulary)",
    )
    d.add_argument(
        "--mask-token-id",
        type=int,
        help="P-EAGLE mask token id (ptd_token_id; default: the tokenizer's mask token "
        "or '<|mask|>')",
    )
    d.add_argument(
        "--norm-before-residual",
        action="store_true",
        help="the first layer's residual is the normed hidden input (norm_before_residual in "
        "config.json; default: the raw fc output, as the released heads)",
    )
    d.add_argument(
        "--freeze-lm-head",
        action="store_true",
        help="keep lm_head at its initial value (the target's rows of the draft vocabulary)",
    )
    d.add_argument(
        "--aux-layer-ids",
        type=int,
        nargs=3,
        help="target feature layers, strictly increasing (default: [2, L//2, L-3], or "
        "[1, L//2, L-1] for targets with fewer than 7 layers)",
    )
    t = p.add_argument_group("layout and schedule")
    t.add_argument(
        "-k",
        "--num-depths",
        type=int,
        default=8,
        help="K: parallel depths (peagle) or serial TTT passes (eagle3); serve with "
        "num_speculative_tokens <= K (default: %(default)s)",
    )
    t.add_argument("--cod-r", type=float, default=0.7, help="COD retention ratio r (default 0.7)")
    t.add_argument("--cod-r-min", type=float, default=0.2, help="COD floor r_min (default 0.2)")
    t.add_argument(
        "--max-anchors",
        type=int,
        help="at most N chains (depth >= 1) start per training sequence, like speculators' "
        "max_anchors: depth 0 keeps every position, so most of the loss moves to depth 0 "
        "(default: no cap)",
    )
    t.add_argument(
        "--prompt-len-field",
        help="JSONL field with each document's prompt length in tokens: labels that predict a "
        "prompt token carry no loss (default: every label is supervised)",
    )
    t.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="sequence partitions per sequence (Algorithm 1; exact gradients, lower "
        "peak memory; default: %(default)s)",
    )
    t.add_argument(
        "--seq-len",
        type=int,
        default=2048,
        help="tokens per training sequence (default: %(default)s)",
    )
    t.add_argument("--steps", type=int, default=1000, help="optimizer steps (default: %(default)s)")
    t.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="forwards (of --pack sequences) per step (default: %(default)s)",
    )
    t.add_argument(
        "--pack",
        type=int,
        default=1,
        help="sequences packed into one forward as separate documents (the mask keeps them "
        "apart; many tokens per launch for small drafters on a GPU; default: %(default)s)",
    )
    t.add_argument(
        "--lr", type=float, default=6e-4, help="peak learning rate, AdamW (default: %(default)s)"
    )
    t.add_argument(
        "--warmup-steps", type=int, default=50, help="linear warmup steps (default: %(default)s)"
    )
    t.add_argument("--weight-decay", type=float, default=0.0, help="(default: %(default)s)")
    t.add_argument(
        "--grad-clip",
        type=float,
        default=1.0,
        help="gradient norm clip, 0 = off (default: %(default)s)",
    )
    r = p.add_argument_group("runtime")
    r.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda if available)")
    r.add_argument(
        "--attention",
        choices=("auto", "flex", "flex-eager", "dense", "chunked"),
        default="auto",
        help="mask kernel (auto: flex on CUDA, chunked SDPA on CPU)",
    )
    r.add_argument(
        "--target-dtype",
        choices=("auto", "bfloat16", "float16", "float32"),
        default="auto",
        help="target weights (auto: bf16 on CUDA, fp32 on CPU)",
    )
    r.add_argument(
        "--save-dtype",
        choices=("bfloat16", "float16", "float32"),
        default="bfloat16",
        help="dtype of model.safetensors (default: %(default)s)",
    )
    r.add_argument(
        "--export-format",
        choices=("eagle3", "speculators"),
        default="eagle3",
        help=(
            "checkpoint format: eagle3 (LlamaForCausalLMEagle3, vLLM's EAGLE-3 path) or "
            "speculators (speculators 0.9: speculators_model_type peagle/eagle3, which "
            "speculators and vLLM's speculators path load) (default: %(default)s)"
        ),
    )
    r.add_argument(
        "--save-every",
        type=int,
        default=200,
        help="steps between checkpoints (default: %(default)s)",
    )
    r.add_argument(
        "--log-every",
        type=int,
        default=10,
        help="steps between log lines: train_log.jsonl, and stdout when there is no progress bar "
        "(default: %(default)s)",
    )
    r.add_argument(
        "--time-limit",
        type=float,
        default=0.0,
        help=(
            "stop (and save) before this many seconds have passed since the start (loading "
            "included; at least one step is made); rerun to resume (0 = none)"
        ),
    )
    r.add_argument(
        "--time-budget",
        type=float,
        default=0.0,
        help="train for about this many seconds (loading and compiling included): the step "
        "count is estimated from the measured time per step and revised after every step "
        "(at most --steps; a resumed run keeps the count its budget ended at; 0 = exactly "
        "--steps)",
    )
    r.add_argument(
        "--time-budget-excludes-startup",
        action="store_true",
        help="count --time-budget from the end of the first step (loading and the first step's "
        "compilation excluded): equal training time for runs of which only some compile, e.g. "
        "ablation variants trained one after another in one process",
    )
    r.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    r.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (there is none either when stderr is not a terminal); log lines "
        "go to stdout every --log-every steps instead",
    )
    p.set_defaults(run=run)
    return p


# (flag, attribute, minimum) of the numeric flags checked before anything is loaded.
_NUMERIC = (
    ("-k/--num-depths", "num_depths", 1),
    ("--partitions", "partitions", 1),
    ("--seq-len", "seq_len", 1),
    ("--steps", "steps", 1),
    ("--grad-accum", "grad_accum", 1),
    ("--pack", "pack", 1),
    ("--warmup-steps", "warmup_steps", 0),
    ("--save-every", "save_every", 1),
    ("--log-every", "log_every", 1),
    ("--num-layers", "num_layers", 1),
    ("--max-anchors", "max_anchors", 0),
    ("--intermediate-size", "intermediate_size", 1),
    ("--draft-vocab-size", "draft_vocab_size", 1),
    ("--mask-token-id", "mask_token_id", 0),
    ("--weight-decay", "weight_decay", 0),
    ("--grad-clip", "grad_clip", 0),
    ("--time-limit", "time_limit", 0),
    ("--time-budget", "time_budget", 0),
)


def check_args(args) -> None:
    """Every input error that can be found before the target is loaded, as a UserError."""
    for flag, attr, low in _NUMERIC:
        value = getattr(args, attr)
        if value is not None and not value >= low:  # `not >=` also refuses NaN
            raise UserError(f"{flag} {value}", f"must be >= {low}")
    if not args.lr > 0:
        raise UserError(f"--lr {args.lr}", "must be > 0")
    if not 0 < args.cod_r <= 1 or not 0 <= args.cod_r_min <= 1:
        raise UserError(f"--cod-r {args.cod_r} --cod-r-min {args.cod_r_min}", "must be in (0, 1]")
    if args.method == "eagle3" and args.partitions != 1:
        raise UserError(
            f"--partitions {args.partitions}",
            "sequence partitioning applies to P-EAGLE only",
            "use --partitions 1 with --method eagle3",
        )
    if args.aux_layer_ids is not None and (
        sorted(set(args.aux_layer_ids)) != args.aux_layer_ids or min(args.aux_layer_ids) < 0
    ):
        raise UserError(
            f"--aux-layer-ids {' '.join(map(str, args.aux_layer_ids))}",
            "must be strictly increasing layer indices >= 0",
            "e.g. 1 L//2 L-1 for an L-layer target",
        )
    for d in args.data:
        if not Path(d).exists():
            raise UserError(f"--data {d}", "no such file or directory")
    check_model_location("--target", args.target)
    if args.tokenizer:
        check_model_location("--tokenizer", args.tokenizer)
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {out}", "exists and is not a directory")
    check_device("--device", args.device)


def _check_target_loads(args, offline: bool) -> None:
    """Read the target's config.json first (cheap): a bad id or path is named in one line."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(args.target)
    except (OSError, ValueError) as e:
        raise UserError(
            f"--target {args.target}",
            HUB_UNREACHABLE if offline else f"cannot be loaded ({first_line(e)})",
            "check the hub id and the network, or pass a local model directory",
        ) from e
    layers = getattr(getattr(config, "text_config", config), "num_hidden_layers", None)
    if args.aux_layer_ids is not None and layers is not None and max(args.aux_layer_ids) >= layers:
        raise UserError(
            f"--aux-layer-ids {' '.join(map(str, args.aux_layer_ids))}",
            f"the target has {layers} layers (ids must be in [0, {layers}))",
            f"e.g. 1 {layers // 2} {layers - 1}",
        )


def run(args) -> int:
    from peagle.train.trainer import TrainConfig, Trainer

    check_args(args)
    offline = go_offline_if_hub_unreachable(args.target)
    if args.no_progress or not sys.stderr.isatty():  # transformers' "Loading weights" bar too
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    _check_target_loads(args, offline)
    cfg = TrainConfig(
        target=args.target,
        tokenizer=args.tokenizer,
        data=args.data,
        data_glob=args.data_glob,
        jsonl_field=args.jsonl_field,
        output=args.output,
        method=args.method,
        num_layers=args.num_layers,
        intermediate_size=args.intermediate_size,
        draft_vocab_size=args.draft_vocab_size,
        mask_token_id=args.mask_token_id,
        aux_layer_ids=args.aux_layer_ids,
        num_depths=args.num_depths,
        cod_r=args.cod_r,
        cod_r_min=args.cod_r_min,
        max_anchors=args.max_anchors,
        prompt_len_field=args.prompt_len_field,
        norm_before_residual=args.norm_before_residual,
        freeze_lm_head=args.freeze_lm_head,
        partitions=args.partitions,
        seq_len=args.seq_len,
        steps=args.steps,
        grad_accum=args.grad_accum,
        pack=args.pack,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        attention=args.attention,
        device=args.device,
        target_dtype=args.target_dtype,
        save_dtype=args.save_dtype,
        export_format=args.export_format,
        save_every=args.save_every,
        log_every=args.log_every,
        time_limit_s=args.time_limit,
        time_budget_s=args.time_budget,
        time_budget_excludes_startup=args.time_budget_excludes_startup,
        seed=args.seed,
        progress=not args.no_progress,
    )
    out = Path(args.output)
    created = not out.exists()
    try:
        try:
            trainer = Trainer(cfg)
        except (ValueError, OSError) as e:
            raise UserError("train", first_line(e)) from e
        result = trainer.run()
    except BaseException:
        # A run that failed before writing anything leaves no empty output directory behind.
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise
    return 0 if result["finished"] else 75
