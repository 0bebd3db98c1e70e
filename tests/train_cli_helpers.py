"""A tiny Llama target + tokenizer + Python corpus for `peagle train` tests (CPU, seconds)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_TEXT = '''def add(a, b):
    """Return the sum of a and b."""
    return a + b


class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count
'''


def make_tiny_train_target(root: Path):
    """``(target_dir, data_dir, tokenizer)`` under ``root``: a 4-layer Llama, BPE tokenizer with
    ``<|mask|>``, three .py files (and a .md one that --data-glob '*.py' skips)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        [TINY_TEXT] * 4,
        vocab_size=300,
        min_frequency=1,
        special_tokens=["<|endoftext|>", "<|mask|>"],
        show_progress=False,
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    target = root / "target"
    tok.save_pretrained(str(target))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        max_position_embeddings=256,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=None,
    )
    LlamaForCausalLM(cfg).save_pretrained(str(target))
    data = root / "data"
    data.mkdir()
    for i in range(3):
        (data / f"f{i}.py").write_text(TINY_TEXT.replace("add", f"add{i}") * (i + 1))
    (data / "notes.md").write_text("not picked by --data-glob")
    return target, data, tok
