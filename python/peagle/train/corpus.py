"""Training corpus: text files, directories of text files, or JSONL → token sequences.

Every file (or JSONL line) is one document. Documents are tokenised without special tokens, the
tokenizer's EOS (if any) is appended, and each document is cut into pieces of at most
``seq_len + 1`` tokens (one training sequence each; pieces shorter than ``min_len`` are dropped),
so no sequence crosses a document boundary. The order is a seeded permutation per epoch, and the
position in it (a single counter) is all a resumed run needs.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch


def iter_documents(
    paths: Sequence[str | Path], glob: str = "*", field: str = "text"
) -> Iterator[str | list[int]]:
    """Yield documents: texts, or token-id lists (see :func:`iter_records`)."""
    for doc, _ in iter_records(paths, glob, field):
        yield doc


def iter_records(
    paths: Sequence[str | Path],
    glob: str = "*",
    field: str = "text",
    prompt_len_field: str | None = None,
) -> Iterator[tuple[str | list[int], int]]:
    """Yield documents: texts, or token-id lists (a JSONL ``field`` holding a list of ints).

    ``*.jsonl`` files give one document per line (``field``), other files one document each;
    directories are searched recursively for files matching ``glob``. Non-JSONL files that are not
    UTF-8 text are skipped (one note on stderr); a JSONL line that is not UTF-8 JSON raises
    ``ValueError`` naming the file and line.

    Each document comes with its prompt length: the JSONL ``prompt_len_field`` (a number of
    leading tokens whose labels carry no loss, e.g. the prompt of a regenerated sequence), or 0
    (no such field asked for, a line without it, a non-JSONL file)."""
    skipped: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files = sorted(f for f in p.rglob(glob) if f.is_file())
        elif p.is_file():
            files = [p]
        else:
            raise FileNotFoundError(f"training data {p} does not exist")
        for f in files:
            if f.suffix == ".jsonl":
                with open(f, "rb") as fh:
                    for i, raw in enumerate(fh):
                        try:
                            line = raw.decode("utf-8")
                            if not line.strip():
                                continue
                            obj = json.loads(line)
                        except (UnicodeDecodeError, json.JSONDecodeError) as e:
                            what = "not UTF-8" if isinstance(e, UnicodeDecodeError) else "not JSON"
                            raise ValueError(f"{f}:{i + 1}: {what} ({e})") from e
                        if not isinstance(obj, dict) or field not in obj:
                            raise ValueError(f"{f}:{i + 1}: JSON object has no {field!r} field")
                        value = obj[field]
                        plen = 0
                        if prompt_len_field is not None:
                            plen = obj.get(prompt_len_field, 0)
                            if not isinstance(plen, int) or plen < 0:
                                raise ValueError(
                                    f"{f}:{i + 1}: {prompt_len_field!r} must be an integer >= 0"
                                )
                        # a list of ints is an already tokenised document (e.g. regenerated
                        # by the target), used as is
                        yield (value if isinstance(value, list) else str(value)), plen
            else:
                try:
                    text = f.read_text(encoding="utf-8")
                except UnicodeDecodeError:
                    skipped.append(f)
                    continue
                yield text, 0
    if skipped:
        print(
            f"peagle train: note: skipped {len(skipped)} file(s) that are not UTF-8 text "
            f"(first: {skipped[0]})",
            file=sys.stderr,
        )


def tokenize_documents(
    texts: Sequence[str], tokenizer, seq_len: int, min_len: int = 16
) -> list[torch.Tensor]:
    """Token sequences (int32, ``min_len <= len <= seq_len + 1``) of the documents, in order.

    Text documents get the tokenizer's EOS appended; token-id lists are taken as they are."""
    return tokenize_documents_with_prompt_lens(texts, None, tokenizer, seq_len, min_len)[0]


def tokenize_documents_with_prompt_lens(
    texts: Sequence[str | list[int]],
    prompt_lens: Sequence[int] | None,
    tokenizer,
    seq_len: int,
    min_len: int = 16,
) -> tuple[list[torch.Tensor], list[int]]:
    """:func:`tokenize_documents` with each piece's prompt length: the prompt tokens of its
    document (``prompt_lens[i]``, default 0) that fall inside the piece."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    eos = getattr(tokenizer, "eos_token_id", None)
    out, plens = [], []
    batch = 256
    for s in range(0, len(texts), batch):
        chunk = list(texts[s : s + batch])
        strs = [t for t in chunk if isinstance(t, str)]
        enc = iter(tokenizer(strs, add_special_tokens=False)["input_ids"] if strs else [])
        for j, doc in enumerate(chunk):
            plen = 0 if prompt_lens is None else int(prompt_lens[s + j])
            if isinstance(doc, str):
                ids = list(next(enc))
                if eos is not None:
                    ids.append(eos)
            else:  # pre-tokenised: used exactly as given
                ids = [int(t) for t in doc]
            for i in range(0, len(ids), seq_len + 1):
                piece = ids[i : i + seq_len + 1]
                if len(piece) >= max(2, min_len):
                    out.append(torch.tensor(piece, dtype=torch.int32))
                    plens.append(max(0, min(len(piece), plen - i)))
    return out, plens


def token_counts(sequences: Sequence[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """``[V]`` int64 occurrences of each token id over the sequences."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in sequences:
        counts += torch.bincount(s.long(), minlength=vocab_size)[:vocab_size]
    return counts


class SequenceOrder:
    """Epoch-wise seeded shuffle; ``sequence(i)`` is the ``i``-th sequence of the whole run."""

    def __init__(self, num_sequences: int, seed: int) -> None:
        if num_sequences < 1:
            raise ValueError(
                "the training corpus yields no sequence (documents shorter than the minimum "
                "length, or every file skipped as not UTF-8 text)"
            )
        self.n = num_sequences
        self.seed = seed
        self._epoch = -1
        self._perm = None

    def index(self, i: int) -> tuple[int, int]:
        """``(epoch, sequence index)`` of global position ``i``."""
        epoch, j = divmod(i, self.n)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.n, generator=g)
            self._epoch = epoch
        return epoch, int(self._perm[j])
