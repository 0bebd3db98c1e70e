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
    pack: int = 1  # sequences per forward (peagle train --pack)
    # peagle train --time-budget: `steps` becomes a cap and the run is sized to end within this
    # many minutes (loading and compiling included); 0 = exactly `steps`
    budget_minutes: float = 0.0


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
    # One H200, under 20 minutes of GPU time: a deeper target trained on 20x its corpus,
    # greedy regeneration, and two heads trained for a fixed time each (6 min, the step count
    # sized by peagle train --time-budget after timing its first steps) on sequences packed into
    # one forward: the drafters are tiny, so a forward costs kernel launches, not FLOPs.
    # Regeneration v2 (after the first H200 run, docs/default-model-pair-gpu.md): short
    # continuations from many prompts. v1 continued 12000 prompts for 448 tokens; past ~100
    # tokens the target's greedy output is mostly loops (60-72 % of those tokens close an 8-gram
    # seen earlier in the sequence), which were 69 % of the drafters' training tokens, scored
    # ~0.8 top-1 there and inflated training accuracy, while acceptance is decided in the first
    # ~96 tokens after a real-code prompt (depth-0 agreement ~0.6 there). Same token budget:
    # 40000 prompts x (64 + 128) tokens.
    "gpu": Recipe(
        name="gpu",
        vocab_size=2048,
        target=TargetShape(hidden_size=256, num_layers=6, intermediate_size=448, num_kv_heads=2),
        target_train=TargetRecipe(steps=4000, batch_size=32, seq_len=512, lr=2e-3, warmup=200),
        peagle=DrafterRecipe(
            num_layers=3,
            intermediate_size=384,
            steps=20000,
            seq_len=512,
            lr=1e-3,
            pack=20,
            budget_minutes=6.0,
        ),  # fmt: skip
        eagle3=DrafterRecipe(
            num_layers=1,
            intermediate_size=384,
            steps=20000,
            seq_len=512,
            lr=1e-3,
            pack=20,
            budget_minutes=6.0,
        ),  # fmt: skip
        draft_vocab_size=1024,
        eval_prompts=96,
        regen_prompts=40000,
        regen_new_tokens=128,
        # greedy continuations only: the evaluation is greedy, and a depth-d label after sampled
        # tokens is the target's distribution behind tokens the drafter cannot know (noise that
        # caps deep-slot accuracy); the CPU pair mixed greedy and temperature-0.7 batches
        regen_temperatures=(0.0,),
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


# -- time plan (printed by --dry-run) ---------------------------------------------------------
# Assumptions for one H200 (the first run, 2026-11-29, measured: target 12 -> 31 ms/step with
# 600 k tok/s; regen 167 s; an unpacked eagle3 step of 4 x 512 tokens ~1 s, i.e. ~250 ms per
# sequence of host-bound launches, hence --pack and the time budgets). Every model here is tiny
# (hidden 256), so the GPU is launch-bound, not FLOP-bound: a step costs a floor of Python +
# kernel-launch time, and only the target's 16 k-token batches come near the matrix units.
H200_EFFECTIVE_FLOPS = 100e12  # bf16, small matrices (of ~790 TFLOP/s peak)
TARGET_STEP_FLOOR_S = 0.030  # HF Llama fwd+bwd+fused AdamW, 6 layers, eager (measured 28-31)
HF_DECODE_STEP_S = 0.0079  # one cached HF forward of the target (regen), batch 256 (measured)
DRAFTER_SEQ_S = {"peagle": 0.020, "eagle3": 0.006}  # per sequence: target fwd, COD, mask, fwd+bwd
EAGLE3_PASS_S = 0.003  # eagle3: per serial TTT pass (block mask + 1-layer fwd/bwd)
DRAFTER_START_S = 60.0  # load target + data, compile FlexAttention fwd/bwd (each call)
ENGINE_STEP_S = 0.015  # one SpecDecoder step (draft + verify), no CUDA graphs
CPU_STAGES_S = 30.0  # tokenizer + tokenize (CPU work on the device's cores)


def target_params(r: Recipe) -> int:
    t = r.target
    h, d = t.hidden_size, t.head_dim
    layer = _layer_params(h, h, h // d, t.num_kv_heads, d, t.intermediate_size)
    return r.vocab_size * h + h + t.num_layers * layer


def estimate_minutes(r: Recipe) -> list[tuple[str, str, float]]:
    """``[(stage, what it does, estimated minutes on one H200)]`` from the recipe alone."""
    tt, t = r.target_train, r.target
    tokens = tt.steps * tt.batch_size * tt.seq_len
    # 6 N per token (fwd + bwd, tied lm_head counted once in N) + causal attention scores
    flops = tokens * (6 * target_params(r) + 6 * t.num_layers * t.hidden_size * tt.seq_len)
    step_s = max(TARGET_STEP_FLOOR_S, flops / tt.steps / H200_EFFECTIVE_FLOPS)
    plan = [
        ("tokenizer+tokenize", "BPE + token streams of the stdlib (CPU)", CPU_STAGES_S / 60),
        (
            "target",
            f"{tt.steps} steps x {tt.batch_size} x {tt.seq_len} = {tokens / 1e6:.1f} M tokens, "
            f"{flops / 1e15:.2f} PFLOP, {step_s * 1e3:.0f} ms/step",
            (tt.steps * step_s + 10) / 60,
        ),
    ]
    if r.regen_prompts > 0:
        batches = -(-r.regen_prompts // r.regen_batch)
        fwd = batches * (r.regen_new_tokens + 1)
        plan.append(
            (
                "regen",
                f"{r.regen_prompts} x ({r.regen_prompt_tokens} + {r.regen_new_tokens}) tokens, "
                f"{batches} batches of {r.regen_batch}, {fwd} cached forwards, "
                f"temperatures {tuple(r.regen_temperatures)}",
                (fwd * HF_DECODE_STEP_S + 10) / 60,
            )
        )
    for name in ("peagle", "eagle3"):
        dr = getattr(r, name)
        if dr.budget_minutes > 0:
            plan.append(
                (
                    name,
                    f"{dr.num_layers} layers, MLP {dr.intermediate_size}, K {dr.k}, "
                    f"{dr.pack} sequences (<= {dr.seq_len} tokens) per forward, steps sized to a "
                    f"{dr.budget_minutes:g}-minute budget (at most {dr.steps})",
                    dr.budget_minutes,
                )
            )
            continue
        seqs = dr.steps * dr.grad_accum * dr.pack
        per_seq = DRAFTER_SEQ_S[name] + (EAGLE3_PASS_S * dr.k if name == "eagle3" else 0.0)
        plan.append(
            (
                name,
                f"{dr.num_layers} layers, MLP {dr.intermediate_size}, K {dr.k}, {dr.steps} steps "
                f"x {dr.grad_accum} x {dr.seq_len} = {seqs * dr.seq_len / 1e6:.1f} M tokens, "
                f"{per_seq * 1e3:.0f} ms/sequence",
                (seqs * per_seq + DRAFTER_START_S) / 60,
            )
        )
    batches = -(-r.eval_prompts // 16)
    steps = 2 * 10 * batches * r.eval_new_tokens / 2.0  # 2 heads, K = 1..10, AL ~2
    plan.append(("package", "copy bf16 pair, 16 MiB check", 0.05))
    plan.append(
        (
            "measure",
            f"2 heads x K 1..10 x {r.eval_prompts} prompts x {r.eval_new_tokens} tokens "
            f"(~{steps:.0f} engine steps at AL ~2)",
            (steps * ENGINE_STEP_S + 20) / 60,
        )
    )
    plan.append(("report", "docs/default-model-pair-<recipe>.md", 0.05))
    return plan
