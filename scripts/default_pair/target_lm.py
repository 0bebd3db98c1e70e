"""Train the default pair's small Llama code model from scratch (a plain causal-LM loop).

Resumable: ``state.pt`` in the run directory holds fp32 weights, optimizer, step and RNG state;
:func:`train_target` trains until ``steps`` or until ``deadline`` (``time.monotonic()`` value),
saves, and returns whether it finished. The finished model is saved in bf16 as a Hugging Face
checkpoint directory (``config.json`` + ``model.safetensors``) with the tokenizer files beside it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class TargetShape:
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_kv_heads: int
    head_dim: int = 64
    max_position_embeddings: int = 2048

    def llama_config(self, vocab_size: int, eos_id: int):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.hidden_size // self.head_dim,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
            pad_token_id=None,
        )


@dataclass
class TargetRecipe:
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup: int = 100
    weight_decay: float = 0.1
    seed: int = 0
    # v3: at most this many passes over the training stream (0 = no cap): the step count is
    # min(steps, max_epochs * stream tokens / (batch_size * seq_len))
    max_epochs: float = 0.0
    # v3: train for about this many minutes (0 = exactly the step count above): after
    # CALIBRATION_STEPS timed steps (during warmup, whose schedule does not depend on the total)
    # the step count is fixed to what fits, at most the capped count; kept across resumes
    budget_minutes: float = 0.0


CALIBRATION_STEPS = 20


def planned_steps(r: TargetRecipe, stream_tokens: int) -> int:
    """The step count before any time budget: ``steps`` capped by ``max_epochs``."""
    if r.max_epochs <= 0:
        return r.steps
    per_epoch = max(1, stream_tokens) / (r.batch_size * r.seq_len)
    return max(1, min(r.steps, int(r.max_epochs * per_epoch)))


def lr_at(step: int, r: TargetRecipe, total: int | None = None) -> float:
    """Linear warmup, then cosine decay to 10 % over ``total`` steps (default ``r.steps``)."""
    total = r.steps if total is None else total
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    frac = (step - r.warmup) / max(1, total - r.warmup)
    return r.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def sample_batch(stream: torch.Tensor, r: TargetRecipe, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - r.seq_len - 1, (r.batch_size,), generator=gen)
    return torch.stack([stream[s : s + r.seq_len] for s in starts.tolist()]).long()


@torch.no_grad()
def eval_loss(
    model,
    stream: torch.Tensor,
    seq_len: int,
    device,
    max_windows: int = 64,
    spread: bool = False,
    batch: int = 1,
) -> float:
    """Mean next-token loss (nats) over ``max_windows`` windows of ``seq_len`` tokens: the first
    ones of the stream (v1/v2), or with ``spread`` evenly spaced over the whole stream (v3: the
    streams are sorted by distribution, so the first windows are one distribution's); ``batch``
    windows per forward."""
    model.eval()
    total = (stream.numel() - 1) // seq_len
    n = min(max_windows, total)
    if spread and n > 1:
        last = stream.numel() - seq_len
        starts = [round(i * last / (n - 1)) for i in range(n)]
    else:
        starts = [i * seq_len for i in range(n)]
    losses = []
    for b in range(0, n, batch):
        x = torch.stack([stream[s : s + seq_len] for s in starts[b : b + batch]]).long().to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            # the mean over the batch's tokens: every window has seq_len - 1 labels
            losses.append(float(model(input_ids=x, labels=x).loss) * x.shape[0])
    model.train()
    return sum(losses) / max(1, n)


def train_target(
    run_dir: Path,
    shape: TargetShape,
    recipe: TargetRecipe,
    vocab_size: int,
    eos_id: int,
    train_stream: torch.Tensor,
    eval_stream: torch.Tensor,
    device: torch.device,
    deadline: float,
    log,
    *,
    eval_windows: int = 64,
    spread_eval: bool = False,
    eval_name: str = "held-out",
) -> bool:
    """Train (or continue) the target; ``True`` once its steps are done.

    The step count is ``recipe.steps``, capped by ``recipe.max_epochs`` and, with
    ``recipe.budget_minutes``, sized to the budget after the first timed steps (the count is
    saved, so a resumed run keeps it). At the end the loss on ``train_stream`` and on
    ``eval_stream`` (named ``eval_name``: the held-out modules in v1/v2, the validation split in
    v3) is measured and written with the run's numbers to ``result.json``.
    """
    import json

    from transformers import LlamaForCausalLM

    run_dir.mkdir(parents=True, exist_ok=True)
    state_path = run_dir / "state.pt"
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(shape.llama_config(vocab_size, eos_id)).to(device)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": recipe.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=recipe.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    gen = torch.Generator().manual_seed(recipe.seed)
    step = 0
    total = planned_steps(recipe, train_stream.numel())
    budget_s = recipe.budget_minutes * 60
    fixed = budget_s <= 0  # the step count is final (no budget, or calibrated already)
    trained_s = 0.0  # training time of earlier calls (the budget counts all of them)
    if state_path.is_file():
        st = torch.load(state_path, map_location="cpu", weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        gen.set_state(st["gen"])
        step = st["step"]
        trained_s = st.get("trained_s", 0.0)
        if st.get("total_steps") is not None:
            total, fixed = st["total_steps"], True
        log(f"target: resumed at step {step}/{total}")
    elif total != recipe.steps or not fixed:
        log(
            f"target: at most {total} steps ({recipe.max_epochs:g} epochs of "
            f"{train_stream.numel()} tokens)"
            + (f", sized to a {recipe.budget_minutes:g}-minute budget" if not fixed else "")
        )

    call_t0 = time.monotonic()

    def save():
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "gen": gen.get_state(),
                "step": step,
                "total_steps": total if fixed else None,
                "trained_s": trained_s + time.monotonic() - call_t0,
            },
            state_path.with_suffix(".tmp"),
        )
        state_path.with_suffix(".tmp").replace(state_path)

    model.train()
    t0, toks, loss_ema = time.monotonic(), 0, None
    first = step
    t_calib = None
    while step < total:
        if step > first and time.monotonic() > deadline:  # at least one step per call
            save()
            log(f"target: paused at step {step}/{total} (time limit)")
            return False
        for g in opt.param_groups:
            g["lr"] = lr_at(step, recipe, total)
        x = sample_batch(train_stream, recipe, gen).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        toks += x.numel()
        lv = loss.item()  # syncs: the step's time is measured below
        loss_ema = lv if loss_ema is None else 0.98 * loss_ema + 0.02 * lv
        if not fixed:
            if step - first == 1:
                t_calib = time.monotonic()  # the first step (allocations, autotuning) not timed
            elif step - first == 1 + CALIBRATION_STEPS:
                step_s = (time.monotonic() - t_calib) / CALIBRATION_STEPS
                left = budget_s - trained_s - (time.monotonic() - call_t0)
                total = max(step, min(total, step + int(left / step_s)))
                fixed = True
                log(
                    f"target: {step_s * 1e3:.0f} ms/step measured; {total} steps fit the "
                    f"{recipe.budget_minutes:g}-minute budget "
                    f"({total * recipe.batch_size * recipe.seq_len / 1e6:.1f} M tokens, "
                    f"{total * recipe.batch_size * recipe.seq_len / train_stream.numel():.2f} "
                    "epochs)"
                )
        if step % 100 == 0 or step == total:
            rate = toks / (time.monotonic() - t0)
            log(
                f"target: step {step}/{total} loss {loss_ema:.4f} "
                f"lr {lr_at(step, recipe, total):.2e} {rate:.0f} tok/s"
            )
        if step % 1000 == 0:
            save()
    save()
    kw = {"max_windows": eval_windows, "spread": spread_eval, "batch": 16 if spread_eval else 1}
    held = eval_loss(model, eval_stream, recipe.seq_len, device, **kw)
    trn = eval_loss(model, train_stream, recipe.seq_len, device, **kw)
    log(f"target: done, train loss {trn:.4f}, {eval_name} loss {held:.4f} nats/token")
    st = torch.load(state_path, map_location="cpu", weights_only=False)
    result = {
        "steps": step,
        "tokens": step * recipe.batch_size * recipe.seq_len,
        "epochs": step * recipe.batch_size * recipe.seq_len / max(1, train_stream.numel()),
        "train_loss": trn,
        f"{eval_name.replace('-', '_')}_loss": held,
        "eval_windows": eval_windows,
        "eval_seq_len": recipe.seq_len,
        "train_minutes": st.get("trained_s", 0.0) / 60,
    }
    (run_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return True


def export_target(
    run_dir: Path,
    shape: TargetShape,
    vocab_size: int,
    eos_id: int,
    out_dir: Path,
    max_shard_bytes: int = 0,
) -> None:
    """Write the finished target as a bf16 Hugging Face checkpoint into ``out_dir``
    (``model.safetensors``, or shards of at most ``max_shard_bytes`` with their index)."""
    from transformers import LlamaForCausalLM

    st = torch.load(run_dir / "state.pt", map_location="cpu", weights_only=False)
    model = LlamaForCausalLM(shape.llama_config(vocab_size, eos_id))
    model.load_state_dict(st["model"])
    # transformers fills a shard with tensors up to max_shard_size; the file adds its header
    kw = {"max_shard_size": int(max_shard_bytes * 0.97)} if max_shard_bytes > 0 else {}
    model.to(torch.bfloat16).save_pretrained(str(out_dir), **kw)
