"""The Python standard library of the running interpreter as a code corpus.

Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` is one document, except test suites
(``test``/``tests``/``idle_test`` directories), ``site-packages`` and files that do not decode as
UTF-8. A fixed list of top-level modules is *held out*: never trained on, used only for evaluation
prompts (the list is chosen by name before any training, not by looking at results).
"""

from __future__ import annotations

import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Top-level stdlib modules/packages whose sources are held out for evaluation. Chosen up front for
# variety (parsing, data structures, networking, text, numbers); none is a dependency of another's
# tests. Never tuned on.
HELD_OUT_MODULES = (
    "json",
    "csv",
    "difflib",
    "fractions",
    "heapq",
    "shlex",
    "textwrap",
    "tomllib",
    "wave",
    "zipfile",
)

_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}


@dataclass(frozen=True)
class Document:
    module: str  # top-level module name ("json" for json/decoder.py)
    relpath: str
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_version() -> str:
    return sys.version.split()[0]


def top_module(relpath: Path) -> str:
    first = relpath.parts[0]
    return first[:-3] if first.endswith(".py") else first


def load_stdlib() -> tuple[list[Document], list[Document]]:
    """``(train_docs, held_out_docs)``, each sorted by path (deterministic)."""
    root = stdlib_root()
    train, held = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in _SKIP_DIRS for part in rel.parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < 64:
            continue
        doc = Document(top_module(rel), str(rel), text)
        (held if doc.module in HELD_OUT_MODULES else train).append(doc)
    return train, held
