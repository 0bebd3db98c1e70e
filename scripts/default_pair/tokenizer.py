"""Byte-level BPE tokenizer for the default pair (trained with ``tokenizers``)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"  # the P-EAGLE mask token (ptd_token_id); never appears in text


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path):
    """Train a byte-level BPE on ``texts`` and save it loadable by ``AutoTokenizer`` (no network).

    Returns the ``PreTrainedTokenizerFast``. Ids 0 and 1 are ``<|endoftext|>`` and ``<|mask|>``.
    """
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(
        texts,
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, MASK_TOKEN],
        show_progress=False,
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        additional_special_tokens=[MASK_TOKEN],
        clean_up_tokenization_spaces=False,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    return tok


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
