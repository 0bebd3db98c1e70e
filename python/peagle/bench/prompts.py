"""Held-out evaluation prompts of the packaged default pair (never the training split).

The default pair was trained on the standard library of the interpreter that built it, minus the
top-level modules listed in ``pair.json`` (``corpus.held_out_modules``). Its held-out evaluation
(``scripts/default_pair/stages.py``, stage ``tokenize``) took windows of ``prompt_tokens`` tokens
from random places in those modules' files, with ``random.Random(1234)``; this module rebuilds the
same prompts (the first 48 are the evaluation's when the interpreter's stdlib is the one recorded
in ``pair.json``) and continues the same random sequence for more.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

# Same file filter as the corpus builder (scripts/default_pair/stdlib_corpus.py).
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}


def held_out_files(modules: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """``[(relpath, text)]`` of the running interpreter's stdlib files under ``modules``, sorted
    by path. Raises ``FileNotFoundError`` when none is found (no stdlib sources installed)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    wanted = set(modules)
    candidates = []
    for m in wanted:  # only the held-out modules' trees, in the corpus builder's path order
        if (root / f"{m}.py").is_file():
            candidates.append(root / f"{m}.py")
        if (root / m).is_dir():
            candidates += (root / m).rglob("*.py")
    files = []
    for path in sorted(candidates):
        rel = path.relative_to(root)
        first = rel.parts[0]
        module = first[:-3] if first.endswith(".py") else first
        if module not in wanted or any(part in _SKIP_DIRS for part in rel.parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) >= 64:
            files.append((str(rel), text))
    if not files:
        raise FileNotFoundError(
            f"no sources of the held-out stdlib modules {sorted(wanted)} under {root}: this "
            "interpreter has no standard-library .py files to build the evaluation prompts from"
        )
    return files


def held_out_prompts(
    tokenizer,
    num_prompts: int,
    modules: list[str] | tuple[str, ...],
    prompt_tokens: int = 96,
    new_tokens: int = 96,
    seed: int = 1234,
) -> list[dict]:
    """``num_prompts`` prompts ``{"prompt", "path", "token_ids"}``: windows of ``prompt_tokens``
    tokens from random places of the held-out files (files with room for ``new_tokens`` more).
    ``token_ids`` re-encode the decoded window (as the evaluation fed it to the engine)."""
    files = held_out_files(modules)
    ids = tokenizer([t for _, t in files], add_special_tokens=False)["input_ids"]
    usable = [i for i, s in enumerate(ids) if len(s) > prompt_tokens + new_tokens]
    if not usable:
        raise ValueError(f"no held-out file is longer than {prompt_tokens + new_tokens} tokens")
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        i = rng.choice(usable)
        start = rng.randrange(0, len(ids[i]) - prompt_tokens - new_tokens)
        text = tokenizer.decode(ids[i][start : start + prompt_tokens])
        token_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        prompts.append({"prompt": text, "path": files[i][0], "token_ids": token_ids})
    return prompts
