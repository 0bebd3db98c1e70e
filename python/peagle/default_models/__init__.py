"""The packaged default model pair: a small Llama code model and its two drafters.

``target/`` is a Llama-architecture model (head_dim 64, bf16) trained from scratch on the Python
standard library of the interpreter recorded in ``pair.json``, with its byte-level BPE tokenizer;
``peagle/`` is its P-EAGLE (parallel) drafter and ``eagle3/`` an autoregressive EAGLE-3 head, both
trained with ``peagle train``. Everything loads from these directories with no network.
``scripts/train_default_pair.py`` reproduces the pair; ``docs/default-model-pair.md`` records how
it was trained and its held-out acceptance lengths.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent
METHODS = ("peagle", "eagle3")


def available() -> bool:
    """True when the pair's files are present (they ship in the wheel)."""
    return (ROOT / "target" / "config.json").is_file() and all(
        (ROOT / m / "config.json").is_file() for m in METHODS
    )


def target_dir() -> Path:
    """Directory of the default target model (transformers ``config.json`` + tokenizer)."""
    return _existing(ROOT / "target")


def drafter_dir(method: str = "peagle") -> Path:
    """Directory of the default drafter for ``method`` (``"peagle"`` or ``"eagle3"``)."""
    if method not in METHODS:
        raise ValueError(f"the default pair has drafters for {METHODS}, not {method!r}")
    return _existing(ROOT / method)


def info() -> dict:
    """``pair.json``: Python version of the corpus, sizes, losses, acceptance lengths."""
    return json.loads(_existing(ROOT / "pair.json").read_text())


def eval_prompts() -> list[dict]:
    """The pair's held-out evaluation prompts as its recipe measured them, for pairs that ship
    them (recipe v3: ``pair.json`` ``eval_prompts.file``, rows ``{"token_ids", "prompt", "unit",
    "path"}`` from the evaluation split's distributions, listed in ``pair.json`` ``corpus``).
    Raises ``FileNotFoundError`` for a pair whose record names none (v1/v2 pairs rebuild theirs
    from the stdlib modules in ``corpus.held_out_modules``: :mod:`peagle.bench.prompts`)."""
    rec = info().get("eval_prompts") or {}
    if not rec.get("file"):
        raise FileNotFoundError(f"{ROOT / 'pair.json'} names no evaluation prompt file")
    with open(_existing(ROOT / rec["file"]), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _existing(path: Path) -> Path:
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: this peagle build has no packaged default model pair "
            "(scripts/train_default_pair.py makes it)"
        )
    return path
