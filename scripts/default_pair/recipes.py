"""Sizes and training budgets of the default pair (CPU variant and the H200 recipe)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from default_pair.target_lm import TargetRecipe, TargetShape


@dataclass
class DrafterRecipe:
    num_layers: int
    intermediate_size: int
    steps: int
    seq_len: int
    lr: float
    k: int = 10  # trained depth (P-EAGLE) / test-time-training steps (EAGLE-3)
    cod_r: float = 0.7
    cod_r_min: float = 0.2
    partitions: int = 1
    grad_accum: int = 1


@dataclass
class Recipe:
    name: str
    vocab_size: int
    target: TargetShape
    target_train: TargetRecipe
    peagle: DrafterRecipe
    eagle3: DrafterRecipe
    draft_vocab_size: int
    eval_prompts: int = 48
    eval_prompt_tokens: int = 96
    eval_new_tokens: int = 96
    max_package_bytes: int = 16 * 1024 * 1024
    # self-distillation data (0 prompts: train the drafters on the raw training split)
    regen_prompts: int = 0
    regen_prompt_tokens: int = 64
    regen_new_tokens: int = 192
    regen_temperatures: tuple = (0.0, 0.7)
    regen_batch: int = 64
    extra: dict = field(default_factory=dict)


RECIPES = {
    # Produced the shipped pair on a 2-core CPU (about an hour of wall time in all).
    "cpu": Recipe(
        name="cpu",
        regen_prompts=2400,
        vocab_size=2048,
        target=TargetShape(hidden_size=256, num_layers=4, intermediate_size=640, num_kv_heads=2),
        target_train=TargetRecipe(steps=1200, batch_size=8, seq_len=256, lr=2e-3, warmup=100),
        peagle=DrafterRecipe(num_layers=2, intermediate_size=384, steps=2000, seq_len=256, lr=1e-3),
        eagle3=DrafterRecipe(num_layers=1, intermediate_size=384, steps=1200, seq_len=256, lr=1e-3),
        draft_vocab_size=1024,
    ),
    # One H200, about 15-20 minutes of GPU time in chunks of --max-minutes 8.5 (not yet run):
    # a deeper target, a 3-layer P-EAGLE drafter, 6x the drafter tokens of the CPU pair.
    "gpu": Recipe(
        name="gpu",
        vocab_size=2048,
        target=TargetShape(hidden_size=256, num_layers=6, intermediate_size=448, num_kv_heads=2),
        target_train=TargetRecipe(steps=4000, batch_size=32, seq_len=512, lr=2e-3, warmup=200),
        peagle=DrafterRecipe(
            num_layers=3, intermediate_size=384, steps=3000, seq_len=512, lr=1e-3, grad_accum=4
        ),
        eagle3=DrafterRecipe(
            num_layers=1, intermediate_size=384, steps=2000, seq_len=512, lr=1e-3, grad_accum=4
        ),
        draft_vocab_size=1024,
        eval_prompts=96,
        regen_prompts=12000,
        regen_new_tokens=448,
        regen_batch=256,
    ),
    # A minutes-long run of every stage (checks the script, not a useful pair).
    "smoke": Recipe(
        name="smoke",
        vocab_size=512,
        target=TargetShape(hidden_size=128, num_layers=4, intermediate_size=256, num_kv_heads=1),
        target_train=TargetRecipe(steps=30, batch_size=4, seq_len=128, lr=2e-3, warmup=5),
        peagle=DrafterRecipe(num_layers=2, intermediate_size=128, steps=6, seq_len=128, lr=1e-3),
        eagle3=DrafterRecipe(num_layers=1, intermediate_size=128, steps=4, seq_len=128, lr=1e-3),
        draft_vocab_size=256,
        eval_prompts=4,
        eval_prompt_tokens=32,
        eval_new_tokens=16,
        regen_prompts=64,
        regen_prompt_tokens=32,
        regen_new_tokens=64,
        regen_batch=32,
    ),
}
# The first CPU run (recorded in docs/default-model-pair.md): drafters on the raw training split.
RECIPES["cpu-raw"] = replace(RECIPES["cpu"], name="cpu-raw", regen_prompts=0)


def _layer_params(h: int, in_size: int, heads: int, kv: int, d: int, inter: int) -> int:
    attn = in_size * heads * d + 2 * in_size * kv * d + heads * d * h
    return attn + 3 * h * inter + 2 * h


def estimate_package_bytes(r: Recipe, tokenizer_bytes: int = 130_000) -> dict[str, int]:
    """bf16 bytes of each part of the pair, from the recipe alone (checked before training)."""
    t = r.target
    h, v, d = t.hidden_size, r.vocab_size, t.head_dim
    heads = h // d
    target = (
        v * h
        + h
        + t.num_layers * _layer_params(h, h, heads, t.num_kv_heads, d, t.intermediate_size)
    )
    out = {"target": 2 * target + tokenizer_bytes}
    for name in ("peagle", "eagle3"):
        dr = getattr(r, name)
        n = (
            v * h + 3 * h * h + h + r.draft_vocab_size * h + h
        )  # embed, fc, norm, lm_head, hidden_norm
        n += _layer_params(h, 2 * h, heads, t.num_kv_heads, d, dr.intermediate_size)
        n += (dr.num_layers - 1) * _layer_params(
            h, h, heads, t.num_kv_heads, d, dr.intermediate_size
        )
        if name == "peagle":
            n += 3 * h  # mask_hidden
        out[name] = 2 * n + 8 * r.draft_vocab_size + v  # d2t int64, t2d bool
    return out
