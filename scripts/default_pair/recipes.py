"""Sizes and training budgets of the default pair (CPU variant and the H200 recipe)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from default_pair.target_lm import TargetRecipe, TargetShape, planned_steps


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
    # the budget counts from the end of the first step (--time-budget-excludes-startup): the
    # ablation's variants, of which the first in each call compiles FlexAttention, train equally
    budget_excludes_startup: bool = False
    # v3 ablation switches (peagle train flags; the defaults are v2's behaviour)
    max_anchors: int = 0  # --max-anchors: chains starting per sequence (0 = no cap)
    exclude_prompt_loss: bool = False  # --prompt-len-field prompt_len (regenerated data)
    norm_before_residual: bool = False  # --norm-before-residual
    freeze_lm_head: bool = False  # --freeze-lm-head
    warmup_steps: int = 50


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
    # -- v3 (issue 19) ------------------------------------------------------------------------
    # "stdlib": the interpreter's standard library, held-out modules by name (v1/v2);
    # "site": every installed Python source, held-out distributions by rule (site_corpus.py)
    corpus: str = "stdlib"
    tokenizer_max_bytes: int = 0  # BPE trained on at most this much training text (0 = all)
    # the training token stream: training-split files in content-hash order up to this many
    # bytes (0 = all; the ablation's reduced scale: the target and regeneration see a subset)
    train_max_bytes: int = 0
    humaneval: bool = False  # also measure on the 164 HumanEval prompts
    humaneval_prompts: int = 0  # the first N of them (0 = all; tests)
    validation_prompts: int = 0  # prompts from the validation split (the ablation's metric)
    regen_budget_minutes: float = 0.0  # stop regenerating after this (0 = all regen_prompts)
    max_shard_bytes: int = 0  # package: safetensors files of at most this size (0 = no limit)
    measure_batch: int = 16  # sequences decoded at once by the measurement
    ks: tuple = tuple(range(1, 11))  # K measured
    report_name: str = ""  # docs/default-model-pair-<report_name>.md (default: the name)


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
    "gpu-v2": Recipe(
        name="gpu-v2",
        report_name="gpu",  # the shipped record, docs/default-model-pair-gpu.md
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

# Recipe v3 (issue 19): a 24-layer target on every Python source of the machine, released-shape
# heads, HumanEval next to held-out packages; one H200 reservation (~28 min in calls < 9.5 min).
# Every GPU stage is sized by time (target, regeneration and heads stop at their budgets, the
# step/prompt counts being caps), so the run fits the reservation whatever the throughput; the
# counts reached are recorded. Sizes: the whole pair bf16 <= 32 MiB, shards <= 15 MiB.
_V3_HEAD = dict(seq_len=256, lr=1e-3, pack=64, steps=200000, intermediate_size=384, k=10)
RECIPES["gpu-v3"] = Recipe(
    name="gpu-v3",
    corpus="site",
    vocab_size=2048,
    tokenizer_max_bytes=64 * 2**20,
    target=TargetShape(hidden_size=256, num_layers=24, intermediate_size=352, num_kv_heads=2),
    target_train=TargetRecipe(
        steps=20000,
        batch_size=64,
        seq_len=1024,
        lr=2e-3,
        warmup=200,
        max_epochs=2.0,
        budget_minutes=4.5,  # ~125 M tokens at the measured 465 k tok/s: ~0.9 epochs
    ),
    # equal budgets: the comparison of the two heads is at equal training time; 5 minutes each
    # so that the whole run fits 3 calls of tools/h200.sh (its --dry-run simulates the calls:
    # with 6 a head is cut at a call's end, pays its load + compile again, and the run needs a
    # 4th call, ~28 min + the machine's start: over one 30-minute reservation)
    peagle=DrafterRecipe(num_layers=4, budget_minutes=5.0, **_V3_HEAD),
    eagle3=DrafterRecipe(num_layers=1, budget_minutes=5.0, **_V3_HEAD),
    draft_vocab_size=1024,
    eval_prompts=96,
    eval_prompt_tokens=96,
    eval_new_tokens=128,
    humaneval=True,
    validation_prompts=64,
    # 10x v2's 7.7 M tokens = 400000 x 192 (the cap): ~3 min at the measured ~3.5 s per batch
    # of 8192 after a ~14-s first batch (the ablation reservation, 2026-12-02)
    regen_prompts=400000,
    regen_prompt_tokens=64,
    regen_new_tokens=128,
    regen_temperatures=(0.0,),
    regen_batch=8192,
    regen_budget_minutes=3.25,
    max_package_bytes=32 * 2**20,
    max_shard_bytes=15 * 2**20,
    measure_batch=64,
)
RECIPES["gpu"] = RECIPES["gpu-v3"]  # --device cuda's recipe
# The ablation's reduced scale (scripts/ablate_default_pair.py; one H200 reservation, every
# stage of it included, in <= 3 calls of < 9.5 min: its --dry-run prints the plan): the same
# corpus split, tokenizer and shapes; the target trains for 2.5 minutes on a 128 MB subset of the
# training split (hash order; ~0.6 epochs of it), 0.5 minutes of regeneration (~7 M tokens by the
# estimate, more than any variant reads in its budget); each variant head trains for the same
# time after its first step and is scored by validation acceptance only.
RECIPES["gpu-v3-ablate"] = replace(
    RECIPES["gpu-v3"],
    name="gpu-v3-ablate",
    train_max_bytes=128 * 10**6,
    target_train=replace(
        RECIPES["gpu-v3"].target_train, budget_minutes=2.5, max_epochs=1.0, warmup=100
    ),
    regen_prompts=50000,
    regen_budget_minutes=0.5,
    humaneval=False,
    eval_prompts=0,
)


def apply_drafter_settings(r: Recipe, settings: dict) -> Recipe:
    """``r`` with the heads' fields overridden: ``{"peagle": {field: value}, "eagle3": {...}}``
    (the ablation driver's choice.json); unknown heads or fields are refused."""
    heads = {}
    for method, fields in settings.items():
        if method not in ("peagle", "eagle3"):
            raise ValueError(f"drafter settings for {method!r}: only peagle and eagle3 exist")
        known = DrafterRecipe.__dataclass_fields__
        bad = sorted(set(fields) - set(known))
        if bad:
            raise ValueError(f"drafter settings for {method}: unknown fields {bad}")
        heads[method] = replace(getattr(r, method), **fields)
    return replace(r, **heads)


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
DRAFTER_START_S = 25.0  # load target + data, compile FlexAttention fwd/bwd (each call; v3: ~20 s)
ENGINE_STEP_S = 0.015  # one SpecDecoder step (draft + verify), no CUDA graphs
CPU_STAGES_S = 30.0  # tokenizer + tokenize (CPU work on the device's cores)


# v3 (corpus "site"): measured by the ablation reservation on the H200 (2026-12-02, commit
# 2ade428, benchmarks/results/default-pair-v3-ablation.log) unless marked otherwise
SITE_CORPUS_BYTES = 394.4e6  # the H200 image's unique .py files (384.4 + 7.5 + 2.5 MB)
SITE_CORPUS_S = 13.0  # find, read, hash 24 k files, write the splits (12.6 s)
BPE_MB_PER_S = 10.0  # tokenizers BPE training, 16 cores (67.3 MB in 6.7 s; 2 cores here: 1.6)
ENCODE_MB_PER_S = 4.4  # stream selection + encode_batch, 16 cores (138 MB in 31.4 s)
TARGET_TOKENS_PER_S_V3 = 465e3  # the 24 x 256 target, steady state (411-470 k tok/s in the log)
TARGET_V3_LAYER_PARAMS = 24 * _layer_params(256, 256, 4, 2, 64, 352)  # the rate above is for it
HF_DECODE_LAYER_S = 0.00113  # per layer of one cached forward at batch 8192 (3.5 s a batch / 129)
REGEN_FIRST_BATCH_S = 11.0  # extra for the first batch of a process (cuDNN plans per length)
DRAFTER_TOKENS_PER_S = {"peagle": 80e3, "eagle3": 32e3}  # 4-layer K=10 76-84 k, 1-layer 30-35 k
TARGET_EXPORT_S = 5.0  # final train/validation loss (256 windows each) + bf16 export (~3 s)
# The ablation's plan (scripts/ablate_default_pair.py --dry-run), per H200 call of tools/h200.sh:
H200_CALL_S = 555.0  # CALL_SECONDS of tools/h200.sh: a call's wall time, build included
H200_CALL_MARGIN_S = 25.0  # tools/h200.sh call_minutes(): the script's deadline is this earlier
BUILD_S = 100.0  # measured: tools/h200.sh's build on the H200, 98 s (the first call only)
CALL_START_S = 15.0  # estimate: Python, torch/transformers imports and CUDA init, every call
DRAFTER_COMPILE_S = 25.0  # the first variant of a call compiles FlexAttention fwd/bwd (~20 s)
VARIANT_LOAD_S = 3.0  # peagle train loads the target + data (~1 s past the budget measured)
VARIANT_SAVE_S = 3.0  # estimate: the final checkpoint + state of a head
MEASURE_LOAD_S = 4.0  # estimate: the pair loaded by the measurement of one variant
ENGINE_STEP_S_V3 = 0.030  # one SpecDecoder step, 24-layer target, batch 64 (ablation: 25-56 ms)
EAGLE3_DRAFT_PASS_S = 0.002  # estimate: each serial EAGLE-3 drafting pass inside a step
TRAIN_SHARE = 0.975  # of the corpus bytes that end in the training split (384.4 of 394.4 MB)
HELD_OUT_MB = 10.0  # validation + evaluation splits (7.5 + 2.5 MB)
BYTES_PER_TOKEN = 2.82  # the 2048-token BPE on the training split (validation 2.92)


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
    if r.corpus == "site":
        return _estimate_minutes_v3(r)
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


def _estimate_minutes_v3(r: Recipe) -> list[tuple[str, str, float]]:
    t, tt = r.target, r.target_train
    corpus_mb = SITE_CORPUS_BYTES / 1e6
    bpe_mb = min(corpus_mb, r.tokenizer_max_bytes / 1e6) if r.tokenizer_max_bytes else corpus_mb
    train_mb = corpus_mb * TRAIN_SHARE
    if r.train_max_bytes:
        train_mb = min(train_mb, r.train_max_bytes / 1e6)
    encode_mb = train_mb + HELD_OUT_MB
    cpu_s = SITE_CORPUS_S + bpe_mb / BPE_MB_PER_S + encode_mb / ENCODE_MB_PER_S
    plan = [
        (
            "tokenizer+tokenize",
            f"corpus v3 (~{corpus_mb:.0f} MB of .py, split by distribution), BPE on "
            f"{bpe_mb:.0f} MB of the training split, token streams of {encode_mb:.0f} MB (CPU)",
            cpu_s / 60,
        )
    ]
    layer_params = t.num_layers * _layer_params(
        t.hidden_size, t.hidden_size, t.hidden_size // t.head_dim, t.num_kv_heads, t.head_dim,
        t.intermediate_size,
    )  # fmt: skip
    rate = TARGET_TOKENS_PER_S_V3 * TARGET_V3_LAYER_PARAMS / layer_params
    train_tokens = train_mb * 1e6 / BYTES_PER_TOKEN
    cap = planned_steps(tt, int(train_tokens)) * tt.batch_size * tt.seq_len
    fit = tt.budget_minutes * 60 * rate if tt.budget_minutes > 0 else cap
    tokens = min(cap, fit)
    target_min = (tokens / rate + TARGET_EXPORT_S) / 60
    plan.append(
        (
            "target",
            f"{t.num_layers} layers x {t.hidden_size}, ~{rate / 1e3:.0f} k tok/s: "
            f"~{tokens / 1e6:.0f} M tokens (~{tokens / train_tokens:.2f} epochs; cap "
            f"{tt.max_epochs:g} epochs = {cap / 1e6:.0f} M) in a {tt.budget_minutes:g}-min budget",
            target_min,
        )
    )
    step_s = HF_DECODE_LAYER_S * t.num_layers
    batch_s = (r.regen_new_tokens + 1) * step_s
    batches = -(-r.regen_prompts // r.regen_batch)
    if r.regen_budget_minutes > 0:  # regen.py: batches start until the budget is spent
        more = math.ceil(max(0.0, r.regen_budget_minutes * 60 - REGEN_FIRST_BATCH_S) / batch_s)
        batches = min(batches, max(1, more))
    seq_tokens = r.regen_prompt_tokens + r.regen_new_tokens
    regen_tokens = batches * r.regen_batch * seq_tokens
    plan.append(
        (
            "regen",
            f"~{batches} batches of {r.regen_batch} x ({r.regen_prompt_tokens} + "
            f"{r.regen_new_tokens}) = ~{regen_tokens / 1e6:.0f} M tokens "
            f"({regen_tokens / 7.68e6:.1f}x v2's 7.7 M; cap {r.regen_prompts} prompts), "
            f"{step_s * 1e3:.0f} ms per cached forward",
            (batches * batch_s + REGEN_FIRST_BATCH_S + 10) / 60,
        )
    )
    for name in ("peagle", "eagle3"):
        dr = getattr(r, name)
        seen = max(0.0, dr.budget_minutes * 60 - DRAFTER_START_S) * DRAFTER_TOKENS_PER_S[name]
        plan.append(
            (
                name,
                f"{dr.num_layers} layers, MLP {dr.intermediate_size}, K {dr.k}, pack {dr.pack}, "
                f"{dr.budget_minutes:g}-min budget: ~{seen / 1e6:.0f} M tokens seen at "
                f"~{DRAFTER_TOKENS_PER_S[name] / 1e3:.0f} k tok/s "
                f"(~{seen / max(1, regen_tokens):.2f} epochs of the data)",
                dr.budget_minutes,
            )
        )
    plan.append(("package", "copy bf16 pair, size and shard checks", 0.05))
    nsets = {"evaluation": r.eval_prompts, "humaneval": 164 if r.humaneval else 0}
    calls = sum(-(-n // r.measure_batch) for n in nsets.values() if n)
    sets = " + ".join(f"{v} {k}" for k, v in nsets.items() if v)
    steps = 2 * len(r.ks) * calls * r.eval_new_tokens / 2.5  # AL ~2.5
    plan.append(
        (
            "measure",
            f"2 heads x K {r.ks[0]}..{r.ks[-1]} x ({sets}) prompts x {r.eval_new_tokens} "
            f"tokens, batch {r.measure_batch} "
            f"(~{steps:.0f} engine steps at AL ~2.5), evaluation-split loss",
            (steps * ENGINE_STEP_S_V3 + 40) / 60,
        )
    )
    plan.append(("report", "docs/default-model-pair-<recipe>.md", 0.05))
    return plan


# -- H200 calls (the --dry-run plans) ---------------------------------------------------------
RESUME_S = 10.0  # estimate: a resumed target / regeneration / measurement reloads its state
DRAFTER_MIN_START_S = 90.0  # stages.py: a head does not start later in a call with less left


def simulate_calls(
    items: list[tuple[str, float, str]],
    call_s: float = H200_CALL_S,
    build_s: float = BUILD_S,
    compile_s: float = DRAFTER_COMPILE_S,
) -> list[list[tuple[str, float]]]:
    """The H200 calls of a ``tools/h200.sh`` mode as lists of ``(item, seconds)``, by the
    scripts' own rules: each call pays ``CALL_START_S`` (the first also the build) and its
    script stops ``H200_CALL_MARGIN_S`` before ``call_s``; ``items`` are ``(name, seconds,
    rule)``, rule ``"split"`` (runs to the deadline and resumes next call, + ``RESUME_S``),
    ``"head"`` (a drafter stage: not started with <= ``DRAFTER_MIN_START_S`` left unless first in
    its call; cut by ``--time-limit`` 15 s before the deadline, resumed with its load + compile
    again) or ``"variant"`` (an ablation variant: started only when it fits, unless first in its
    call; the first variant of a call adds ``compile_s``). A call in which nothing fits still
    makes progress with its first item."""
    deadline = call_s - H200_CALL_MARGIN_S
    calls: list[list[tuple[str, float]]] = [[("start", CALL_START_S), ("build", build_s)]]
    t = CALL_START_S + build_s
    did = False  # anything but start/build in this call
    compiled = False  # a variant compiled in this call

    def new_call() -> None:
        nonlocal t, did, compiled
        calls.append([("start", CALL_START_S)])
        t, did, compiled = CALL_START_S, False, False

    for name, seconds, rule in items:
        left = seconds
        while left > 1e-9:
            room = deadline - t
            if rule == "variant":
                need = left + (0.0 if compiled else compile_s)
                if did and need > room:
                    new_call()
                    continue
                calls[-1].append((name, need))
                t += need
                compiled = did = True
                left = 0.0
            elif rule == "head":
                if did and room <= DRAFTER_MIN_START_S:
                    new_call()
                    continue
                part = min(left, max(1.0, room - 15.0))
                calls[-1].append((name, part))
                t += part
                did = True
                left -= part
                if left > 1e-9:
                    new_call()
                    left += DRAFTER_START_S
            else:
                if did and room <= 0:
                    new_call()
                    continue
                part = min(left, max(1.0, room))
                calls[-1].append((name, part))
                t += part
                did = True
                left -= part
                if left > 1e-9:
                    new_call()
                    left += RESUME_S
        if t > deadline:  # the scripts stop between stages once past the deadline
            new_call()
    if len(calls[-1]) == 1 and len(calls) > 1:  # a trailing call with nothing in it
        calls.pop()
    return calls


def format_calls(calls: list[list[tuple[str, float]]]) -> list[str]:
    """One line per call: its estimated minutes and what runs in it (repeats merged)."""
    out = []
    for i, c in enumerate(calls, 1):
        names = list(dict.fromkeys(n for n, _ in c))
        out.append(f"call {i}: {sum(s for _, s in c) / 60:4.1f} min  {' + '.join(names)}")
    return out
