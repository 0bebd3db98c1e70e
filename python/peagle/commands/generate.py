"""``peagle generate``: speculative generation for prompts from flags, a file or stdin."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DESCRIPTION = """\
Generate text with a target model and a P-EAGLE (parallel) or EAGLE-3 (serial) drafter.
Greedy output (--temperature 0) is the target model's own greedy output; speculation only
makes it faster. Prompts come from --prompt (repeatable), --prompts-file, or stdin (one prompt
per line, or JSONL objects with a "prompt" field)."""

EPILOG = """\
examples:
  peagle generate --model meta-llama/Llama-3.1-8B-Instruct --draft-model ./llama3-8b-p-eagle \\
      --method peagle -k 5 --prompt "Write a haiku about GPUs." --max-new-tokens 128

  printf 'first prompt\\nsecond prompt\\n' | \\
      peagle generate --model ./target --draft-model ./drafter --json > out.jsonl

  peagle generate --model ./target --method none --prompts-file prompts.jsonl --temperature 0.7
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "generate",
        help="generate text with speculative decoding",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m = p.add_argument_group("models")
    m.add_argument(
        "--model",
        help="target model: a Hugging Face causal LM directory or hub id (Llama 3, Qwen3 dense, "
        "Qwen3-MoE, GPT-OSS; see docs/targets.md). MXFP4 checkpoints (GPT-OSS) load with "
        "transformers' MXFP4 kernels when usable, else dequantized to bf16 with a memory "
        "estimate printed first (PEAGLE_MXFP4=auto|dequantize|native). Default: the packaged "
        "default pair, a small code model trained on the Python standard library "
        "(docs/default-model-pair.md).",
    )
    m.add_argument(
        "--draft-model",
        help="drafter checkpoint directory (config.json + model.safetensors in the P-EAGLE / "
        "EAGLE-3 layout, e.g. amazon/*-p-eagle, or the speculators format, e.g. "
        "RedHatAI/*-speculator.peagle). Required with --model unless --method none; "
        "without --model, the packaged pair's drafter for --method.",
    )
    m.add_argument(
        "--method",
        choices=("peagle", "eagle3", "none"),
        default="peagle",
        help="peagle: K drafts from ONE drafter pass (needs mask_hidden in the checkpoint); "
        "eagle3: K serial drafter passes; none: plain decoding (default: %(default)s)",
    )
    m.add_argument(
        "-k",
        "--num-speculative-tokens",
        type=int,
        default=5,
        help="drafts per step K; at most the depth the drafter was trained for "
        "(default: %(default)s)",
    )
    i = p.add_argument_group("prompts")
    i.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="a prompt (repeat the flag for several)",
    )
    i.add_argument(
        "--prompts-file",
        help="file with one prompt per line, or JSONL with a 'prompt' field per line "
        "('-' = stdin). Without --prompt/--prompts-file, prompts are read from stdin.",
    )
    i.add_argument(
        "--chat-template",
        default="auto",
        help="'auto': wrap each prompt as a user message with the tokenizer's chat template "
        "when it has one; 'none': feed the raw text; or a path to a Jinja template file "
        "(default: %(default)s)",
    )
    s = p.add_argument_group("sampling")
    s.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 = greedy (default); > 0 samples with exact rejection sampling",
    )
    s.add_argument("--top-k", type=int, default=0, help="top-k filter (0 = off)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus filter (1.0 = off)")
    s.add_argument(
        "--seed",
        type=int,
        default=None,
        help="random seed; prompt i uses seed + i, so reruns reproduce (default: random)",
    )
    s.add_argument(
        "--max-new-tokens", type=int, default=128, help="tokens per prompt (default: %(default)s)"
    )
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS (benchmarking)")
    r = p.add_argument_group("runtime")
    r.add_argument(
        "--device",
        default=None,
        help="cpu, cuda or cuda:N (default: cuda if available, else cpu)",
    )
    r.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float16", "float32"),
        default="auto",
        help="model dtype (auto: bfloat16 on CUDA, float32 on CPU)",
    )
    r.add_argument(
        "--max-num-seqs",
        type=int,
        default=8,
        help="prompts decoded together in one batch (default: %(default)s)",
    )
    r.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + generated tokens per request, sizes the KV cache (default: longest "
        "prompt + --max-new-tokens, capped at the target's max_position_embeddings)",
    )
    r.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly on CUDA")
    o = p.add_argument_group("output")
    o.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per prompt per line: text, num_generated_tokens, "
        "acceptance_length, tokens_per_second, per_position_acceptance, finish_reason, ...",
    )
    o.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.set_defaults(run=run)
    return p


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------


def parse_prompt_lines(lines, source: str) -> list[str]:
    """One prompt per non-empty line; a line starting with ``{`` is a JSON object with a
    ``prompt`` (or ``text``) field, one starting with ``"`` a JSON string."""
    prompts = []
    for n, line in enumerate(lines, 1):
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.lstrip()[:1] in ("{", '"'):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"peagle generate: {source}:{n}: invalid JSON: {e}") from e
            if isinstance(obj, dict):
                text = obj.get("prompt", obj.get("text"))
                if not isinstance(text, str):
                    raise SystemExit(
                        f"peagle generate: {source}:{n}: JSON object needs a string 'prompt'"
                    )
                obj = text
            prompts.append(obj)
        else:
            prompts.append(line)
    return prompts


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file == "-":
        prompts += parse_prompt_lines(sys.stdin, "<stdin>")
    elif args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise SystemExit(f"peagle generate: --prompts-file {path} does not exist")
        with open(path, encoding="utf-8") as f:
            prompts += parse_prompt_lines(f, str(path))
    elif not prompts:
        if sys.stdin is None or sys.stdin.isatty():
            raise SystemExit(
                "peagle generate: no prompts: pass --prompt, --prompts-file, or pipe prompts "
                "into stdin (see --help)"
            )
        prompts += parse_prompt_lines(sys.stdin, "<stdin>")
    if not prompts:
        raise SystemExit("peagle generate: the prompt input is empty")
    return prompts


def encode_prompt(tokenizer, prompt: str, chat_template: str) -> list[int]:
    """Token ids of one prompt, through the chat template when asked for / available."""
    template = None
    if chat_template == "auto":
        use = getattr(tokenizer, "chat_template", None) is not None
    elif chat_template == "none":
        use = False
    else:
        path = Path(chat_template)
        if not path.is_file():
            raise SystemExit(f"peagle generate: --chat-template {chat_template}: no such file")
        template = path.read_text()
        use = True
    if not use:
        return list(tokenizer(prompt)["input_ids"])
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        chat_template=template,
        add_generation_prompt=True,
        tokenize=False,
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def eos_ids(tokenizer, target) -> list[int]:
    ids = set()
    for src in (
        tokenizer.eos_token_id,
        getattr(target.model.generation_config, "eos_token_id", None),
    ):
        if src is None:
            continue
        ids.update([src] if isinstance(src, int) else list(src))
    return sorted(ids)


# ---------------------------------------------------------------------------------------------
# Command
# ---------------------------------------------------------------------------------------------


def _check_args(args) -> None:
    if not args.model:
        from peagle import default_models

        if not default_models.available():
            raise SystemExit(
                "peagle generate: --model is required (this build has no packaged default model "
                "pair): pass a target model directory or hub id"
            )
        # The packaged pair: a small code model trained on the Python standard library and its
        # drafters (docs/default-model-pair.md); loads with no network.
        args.model = str(default_models.target_dir())
        if args.method != "none" and not args.draft_model:
            args.draft_model = str(default_models.drafter_dir(args.method))
    if args.method != "none" and not args.draft_model:
        raise SystemExit(
            f"peagle generate: --method {args.method} needs --draft-model (a P-EAGLE / EAGLE-3 "
            "drafter checkpoint), or use --method none"
        )
    if args.method != "none" and args.num_speculative_tokens < 1:
        raise SystemExit("peagle generate: -k/--num-speculative-tokens must be >= 1")
    if args.max_new_tokens < 1:
        raise SystemExit("peagle generate: --max-new-tokens must be >= 1")


def _warn_beyond_trained_depth(drafter, k: int) -> None:
    """K past the depth a drafter was trained for runs, but its extra slots are untrained."""
    depth = (
        None if drafter is None else drafter.config.raw.get("peagle_training", {}).get("num_depths")
    )
    if depth is not None and k > depth:
        print(
            f"peagle generate: warning: K={k} exceeds the depth this drafter was trained for "
            f"({depth}); drafts past it come from untrained slots and are rarely accepted",
            file=sys.stderr,
        )


def run(args) -> int:
    _check_args(args)
    prompts = read_prompts(args)

    import torch
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from peagle.decode import SamplingParams, SpecDecoder
    from peagle.models import load_model_pair

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    if device.type == "cuda" and dtype == torch.float32:
        raise SystemExit("peagle generate: the CUDA kernels run bfloat16/float16; use --dtype auto")
    if args.seed is not None:
        torch.manual_seed(args.seed)
    if args.no_progress:  # transformers' own "Loading weights" bar too
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        target, drafter = load_model_pair(
            args.model,
            None if args.method == "none" else args.draft_model,
            device=device,
            dtype=dtype,
        )
        _warn_beyond_trained_depth(drafter, args.num_speculative_tokens)
        token_ids = [encode_prompt(tokenizer, p, args.chat_template) for p in prompts]
        # KV sized for the longest request this run can produce, unless told otherwise.
        max_len = args.max_model_len or max(len(t) for t in token_ids) + args.max_new_tokens
        engine = SpecDecoder(
            target,
            drafter,
            method=args.method,
            num_speculative_tokens=args.num_speculative_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=max_len,
            eos_token_ids=eos_ids(tokenizer, target),
            cuda_graphs="off" if args.no_cuda_graphs else "auto",
        )
        params = [
            SamplingParams(
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=None if args.seed is None else args.seed + i,
                max_new_tokens=args.max_new_tokens,
                ignore_eos=args.ignore_eos,
            )
            for i in range(len(prompts))
        ]
        with tqdm(
            total=len(prompts),
            desc="prompts",
            unit="prompt",
            file=sys.stderr,
            disable=args.no_progress or len(prompts) <= 1,
        ) as bar:
            outputs = engine.generate(token_ids, params, on_finish=lambda _: bar.update(1))
    except (ValueError, FileNotFoundError, OSError) as e:
        raise SystemExit(f"peagle generate: {e}") from e

    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        st = out.stats
        if args.json:
            record = {
                "prompt": prompt,
                "text": text,
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason,
                **st.to_dict(),
            }
            print(json.dumps(record), flush=True)
            continue
        if len(prompts) > 1:
            print(f"=== [{i}] {prompt}")
        print(text, flush=True)
        print(
            f"[{i}] {st.num_generated_tokens} tokens ({out.finish_reason}), acceptance length "
            f"{st.acceptance_length:.2f}, {st.tokens_per_second:.1f} tok/s",
            file=sys.stderr,
        )
    return 0
