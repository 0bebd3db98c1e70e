"""``peagle generate``: speculative generation for prompts from flags, a file or stdin."""

from __future__ import annotations

import argparse
import json
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
Generate text with a target model and a P-EAGLE (parallel) or EAGLE-3 (serial) drafter.
Greedy output (--temperature 0) is the target model's own greedy output with every method.
Speculation pays only when a target pass costs much more than a drafter pass; on the packaged
tiny pair it is at best about even. Measured tokens/s, none vs P-EAGLE vs EAGLE-3 (greedy):
  2 shared CPU cores, 1 thread, 1 prompt, K=3: none 114, P-EAGLE 121, EAGLE-3 94 (medians of
    3 runs on a loaded machine; ranges in docs/build-modes.md)
  H200, concurrency 1 (64 prompts, 128 tok): none 1605, P-EAGLE 1562 (K=3), EAGLE-3 1684 (K=1)
  H200, concurrency 16 / 64:                 speculation 0.10-0.57x of none (every K measured)
(H200: docs/results.md, benchmarks/results/e2e-h200.json). `peagle tune` finds the best K and the
break-even point for a pair from `peagle bench e2e` results. On the CPU, peagle runs one thread
unless OMP_NUM_THREADS or --threads says otherwise (see --threads).
Prompts come from --prompt (repeatable), --prompts-file, or stdin (one prompt per line, or JSONL
objects with a "prompt" field; blank lines are skipped, with a note on stderr)."""

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
        help="drafts per step K (default: %(default)s). With --method peagle, at most the depth "
        "the drafter was trained for (its config's peagle_training.num_depths; the packaged "
        "drafters: 10): the parallel slots past it were never trained. --method eagle3 runs "
        "past its trained depth with a warning.",
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
        help="prompts decoded together in one batch, >= 1 (default: %(default)s)",
    )
    r.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: $OMP_NUM_THREADS when set, else 1 on the CPU: the "
        "decode loop's matmuls have a few rows, and threads waiting on each other cost more "
        "than they save, badly so on a loaded machine; raise it for large targets)",
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


def _decode_line(line: bytes | str, where: str) -> str:
    """One input line as text; bytes that are not UTF-8 are a user error (stdin under a UTF-8
    locale hands them over as lone surrogates, which the tokenizer then rejects)."""
    try:
        if isinstance(line, bytes):
            return line.decode("utf-8")
        line.encode("utf-8")
        return line
    except UnicodeError as e:
        raise UserError(where, f"not UTF-8 text ({e.reason})", "convert the input to UTF-8") from e


def parse_prompt_lines(lines, source: str) -> list[str]:
    """One prompt per non-empty line; a line starting with ``{`` is a JSON object with a
    ``prompt`` (or ``text``) field, one starting with ``"`` a JSON string. Blank lines are
    skipped with a note on stderr."""
    prompts, blank = [], 0
    for n, raw in enumerate(lines, 1):
        line = _decode_line(raw, f"{source}:{n}").rstrip("\r\n")
        if not line.strip():
            blank += 1
            continue
        if line.lstrip()[:1] in ("{", '"'):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{source}:{n}", f"invalid JSON ({e})") from e
            if isinstance(obj, dict):
                text = obj.get("prompt", obj.get("text"))
                if not isinstance(text, str):
                    raise UserError(f"{source}:{n}", "a JSON object needs a string 'prompt'")
                obj = text
            if not isinstance(obj, str):
                raise UserError(f"{source}:{n}", "a JSON line must be an object or a string")
            prompts.append(_decode_line(obj, f"{source}:{n}"))
        else:
            prompts.append(line)
    if blank:
        print(f"peagle generate: note: skipped {blank} blank line(s) in {source}", file=sys.stderr)
    return prompts


def read_prompts(args) -> list[str]:
    prompts = [_decode_line(p, "--prompt") for p in args.prompt]
    if args.prompts_file == "-":
        prompts += parse_prompt_lines(_stdin_lines(), "<stdin>")
    elif args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise UserError(f"--prompts-file {path}", "no such file")
        with open(path, "rb") as f:
            prompts += parse_prompt_lines(f, str(path))
    elif not prompts:
        if sys.stdin is None or sys.stdin.isatty():
            raise UserError(
                "no prompts",
                "none given",
                "pass --prompt, --prompts-file, or pipe prompts into stdin",
            )
        prompts += parse_prompt_lines(_stdin_lines(), "<stdin>")
    if not prompts:
        raise UserError("prompts", "the prompt input is empty", "pass at least one prompt")
    return prompts


def _stdin_lines():
    """stdin's lines as bytes when it has a byte buffer (strict UTF-8 decoding per line)."""
    buf = getattr(sys.stdin, "buffer", None)
    return buf if buf is not None else sys.stdin


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
            raise UserError(f"--chat-template {chat_template}", "no such file")
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


# (flag, attribute, minimum, what it is) of every numeric argument; checked before
# anything is loaded (SpecDecoder checks its own again: peagle.decode.config).
_NUMERIC = (
    ("-k/--num-speculative-tokens", "num_speculative_tokens", 1, "drafts per step"),
    ("--max-num-seqs", "max_num_seqs", 1, "prompts per batch"),
    ("--max-model-len", "max_model_len", 2, "tokens per request"),
    ("--max-new-tokens", "max_new_tokens", 1, "tokens per prompt"),
    ("--top-k", "top_k", 0, "0 = off"),
    ("--threads", "threads", 1, "CPU threads"),
)


def check_numbers(args) -> None:
    """Refuse a numeric flag out of range, naming it (before any model is loaded)."""
    for flag, attr, low, what in _NUMERIC:
        value = getattr(args, attr)
        if value is None or (attr == "num_speculative_tokens" and args.method == "none"):
            continue
        if value < low:
            raise UserError(f"{flag} {value}", f"must be >= {low} ({what})")
    if not args.temperature >= 0:  # also NaN
        raise UserError(f"--temperature {args.temperature}", "must be >= 0 (0 = greedy)")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p {args.top_p}", "must be in (0, 1] (1 = off)")


def _check_args(args) -> None:
    check_numbers(args)
    if not args.model:
        from peagle import default_models

        if not default_models.available():
            raise UserError(
                "--model",
                "required: this build has no packaged default model pair",
                "pass a target model directory or hub id",
            )
        # The packaged pair: a small code model trained on the Python standard library and its
        # drafters (docs/default-model-pair.md); loads with no network.
        args.model = str(default_models.target_dir())
        if args.method != "none" and not args.draft_model:
            args.draft_model = str(default_models.drafter_dir(args.method))
    check_model_location("--model", args.model)
    if args.method != "none" and not args.draft_model:
        raise UserError(
            f"--method {args.method}",
            "needs --draft-model (a P-EAGLE / EAGLE-3 drafter checkpoint)",
            "pass --draft-model, or use --method none",
        )
    if Path(args.model).is_dir():
        _check_safetensors(Path(args.model))
    if args.method != "none":
        check_model_location("--draft-model", args.draft_model)
        args.draft_model = str(_drafter_dir(args.draft_model))
        config, names = _check_drafter_files(Path(args.draft_model))
        depth = (config.get("peagle_training") or {}).get("num_depths")
        _check_k_against_drafter(depth, args.method, args.num_speculative_tokens)
        _note_method_mismatch("mask_hidden" in names, args.method)


def _drafter_dir(location: str) -> Path:
    """The drafter's directory: a local one, or a hub id fetched into the hub cache."""
    from peagle.models.loader import resolve_drafter_dir

    if Path(location).expanduser().is_dir():
        return Path(location).expanduser()
    offline = go_offline_if_hub_unreachable(location)
    try:
        return resolve_drafter_dir(location)
    except (OSError, ValueError) as e:  # huggingface_hub's errors are OSError / ValueError
        raise UserError(
            f"--draft-model {location}",
            HUB_UNREACHABLE if offline else f"cannot be downloaded ({first_line(e)})",
            "check the hub id and the network, or pass a local drafter directory",
        ) from e


def _check_drafter_files(path: Path) -> tuple[dict, set[str]]:
    """The drafter's config.json and tensor names, read cheaply before anything loads."""
    if not (path / "config.json").is_file():
        raise UserError(f"--draft-model {path}", "no config.json", "pass a drafter checkpoint")
    try:
        config = json.loads((path / "config.json").read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(
            f"{path / 'config.json'}", f"not valid JSON ({e})", "re-save the drafter checkpoint"
        ) from e
    if not isinstance(config, dict):
        raise UserError(
            f"{path / 'config.json'}", "not a JSON object", "re-save the drafter checkpoint"
        )
    return config, _check_safetensors(path)


def _check_safetensors(path: Path) -> set[str]:
    """Read each safetensors header (cheap): a truncated file is named, not a traceback.
    Returns the tensor names."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                names.update(st.keys())
        except Exception as e:  # noqa: BLE001  (SafetensorError and OS errors alike)
            raise UserError(
                str(f),
                f"not a readable safetensors file ({first_line(e)})",
                "re-download or re-save the checkpoint",
            ) from e
    return names


def _check_k_against_drafter(depth: int | None, method: str, k: int) -> None:
    """P-EAGLE's parallel slots past the trained depth were never trained: refuse. EAGLE-3's
    serial passes reuse the same head, so K past its depth runs, with a warning."""
    if depth is None or k <= depth:
        return
    if method == "peagle":
        raise UserError(
            f"-k {k}",
            f"this P-EAGLE drafter was trained for at most {depth} parallel drafts",
            f"use -k 1..{depth}, or a drafter trained with peagle train -k {k}",
        )
    print(
        f"peagle generate: warning: K={k} exceeds the depth this drafter was trained for "
        f"({depth}); the serial passes past it are rarely accepted, and each one still costs a "
        "drafter forward",
        file=sys.stderr,
    )


def _note_method_mismatch(parallel: bool, method: str) -> None:
    if method == "eagle3" and parallel:
        print(
            "peagle generate: note: this is a P-EAGLE drafter (it has mask_hidden); --method "
            "eagle3 runs it serially, K passes per step; --method peagle drafts all K in one pass",
            file=sys.stderr,
        )


def _set_threads(args, device) -> None:
    """1 CPU thread unless told otherwise (see --threads)."""
    import os

    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif device.type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)


def _finish_text(out, max_new_tokens: int) -> str:
    if out.finish_reason == "stop":
        return "stopped at EOS / a stop token"
    if out.stats.num_generated_tokens >= max_new_tokens:
        return "reached --max-new-tokens"
    return "reached --max-model-len"


def run(args) -> int:
    _check_args(args)
    prompts = read_prompts(args)

    import torch
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from peagle.decode import SamplingParams, SpecDecoder
    from peagle.models import load_model_pair

    device = torch.device(check_device("--device", args.device))
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    if device.type == "cuda" and dtype == torch.float32:
        raise UserError(
            "--dtype float32", "the CUDA kernels run bfloat16/float16", "use --dtype auto"
        )
    _set_threads(args, device)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    progress = not args.no_progress and sys.stderr.isatty()
    if not progress:  # transformers' own "Loading weights" bar too
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    offline = go_offline_if_hub_unreachable(args.model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as e:
        why = HUB_UNREACHABLE if offline else f"cannot load a tokenizer ({first_line(e)})"
        raise UserError(
            f"--model {args.model}",
            why,
            "check the hub id and the network, or pass a local model directory",
        ) from e
    models = f"--model {args.model}" + (
        "" if args.method == "none" else f" --draft-model {args.draft_model}"
    )
    try:
        target, drafter = load_model_pair(
            args.model,
            None if args.method == "none" else args.draft_model,
            device=device,
            dtype=dtype,
        )
    except (ValueError, OSError, KeyError) as e:
        raise UserError(
            models, first_line(e), "check that the drafter was trained for this target"
        ) from e
    try:
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
            disable=not progress or len(prompts) <= 1,
        ) as bar:
            outputs = engine.generate(token_ids, params, on_finish=lambda _: bar.update(1))
    except (ValueError, FileNotFoundError) as e:
        raise UserError("generate", first_line(e), "see peagle generate --help") from e

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
        print(f"=== [{i}] {prompt}")
        print(text, flush=True)
        print(
            f"[{i}] {st.num_generated_tokens} tokens ({_finish_text(out, args.max_new_tokens)}), "
            f"acceptance length {st.acceptance_length:.2f}, {st.tokens_per_second:.1f} tok/s",
            file=sys.stderr,
        )
    return 0
