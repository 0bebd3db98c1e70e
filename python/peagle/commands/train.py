"""``peagle train``: train a P-EAGLE drafter or an EAGLE-3 head for a Hugging Face target."""

from __future__ import annotations

import argparse

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
    io.add_argument("--jsonl-field", default="text", help="JSONL field with the document text")
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
        "--aux-layer-ids", type=int, nargs=3, help="target feature layers (default [2, L//2, L-3])"
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
        "--partitions",
        type=int,
        default=1,
        help="sequence partitions per sequence (Algorithm 1; exact gradients, lower "
        "peak memory; default: %(default)s)",
    )
    t.add_argument("--seq-len", type=int, default=2048, help="tokens per training sequence")
    t.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    t.add_argument(
        "--grad-accum", type=int, default=1, help="forwards (of --pack sequences) per step"
    )
    t.add_argument(
        "--pack",
        type=int,
        default=1,
        help="sequences packed into one forward as separate documents (the mask keeps them "
        "apart; many tokens per launch for small drafters on a GPU; default: %(default)s)",
    )
    t.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (AdamW)")
    t.add_argument("--warmup-steps", type=int, default=50)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--grad-clip", type=float, default=1.0)
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
    r.add_argument("--save-dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    r.add_argument(
        "--export-format",
        choices=("eagle3", "speculators"),
        default="eagle3",
        help=(
            "checkpoint format: eagle3 (LlamaForCausalLMEagle3, vLLM's EAGLE-3 path; default) or "
            "speculators (speculators 0.9: speculators_model_type peagle/eagle3, which "
            "speculators and vLLM's speculators path load)"
        ),
    )
    r.add_argument("--save-every", type=int, default=200, help="steps between checkpoints")
    r.add_argument("--log-every", type=int, default=10, help="steps between log lines")
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
        "count is fixed after timing the first steps (at most --steps; kept on resume; "
        "0 = exactly --steps)",
    )
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    from peagle.train.trainer import TrainConfig, train

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
        seed=args.seed,
        progress=not args.no_progress,
    )
    result = train(cfg)
    return 0 if result["finished"] else 75
