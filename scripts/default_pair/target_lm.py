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


def lr_at(step: int, r: TargetRecipe) -> float:
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    frac = (step - r.warmup) / max(1, r.steps - r.warmup)
    return r.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def sample_batch(stream: torch.Tensor, r: TargetRecipe, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - r.seq_len - 1, (r.batch_size,), generator=gen)
    return torch.stack([stream[s : s + r.seq_len] for s in starts.tolist()]).long()


@torch.no_grad()
def eval_loss(model, stream: torch.Tensor, seq_len: int, device, max_windows: int = 64) -> float:
    """Mean next-token loss (nats) over consecutive held-out windows."""
    model.eval()
    n = min(max_windows, (stream.numel() - 1) // seq_len)
    losses = []
    for i in range(n):
        x = stream[i * seq_len : (i + 1) * seq_len].long().unsqueeze(0).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            losses.append(float(model(input_ids=x, labels=x).loss))
    model.train()
    return sum(losses) / max(1, len(losses))


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
) -> bool:
    """Train (or continue) the target; ``True`` once ``recipe.steps`` steps are done."""
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
    if state_path.is_file():
        st = torch.load(state_path, map_location="cpu", weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        gen.set_state(st["gen"])
        step = st["step"]
        log(f"target: resumed at step {step}/{recipe.steps}")

    def save():
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "gen": gen.get_state(),
                "step": step,
            },
            state_path.with_suffix(".tmp"),
        )
        state_path.with_suffix(".tmp").replace(state_path)

    model.train()
    t0, toks, loss_ema = time.monotonic(), 0, None
    first = step
    while step < recipe.steps:
        if step > first and time.monotonic() > deadline:  # at least one step per call
            save()
            log(f"target: paused at step {step}/{recipe.steps} (time limit)")
            return False
        for g in opt.param_groups:
            g["lr"] = lr_at(step, recipe)
        x = sample_batch(train_stream, recipe, gen).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        toks += x.numel()
        lv = loss.item()
        loss_ema = lv if loss_ema is None else 0.98 * loss_ema + 0.02 * lv
        if step % 100 == 0 or step == recipe.steps:
            rate = toks / (time.monotonic() - t0)
            log(
                f"target: step {step}/{recipe.steps} loss {loss_ema:.4f} "
                f"lr {lr_at(step, recipe):.2e} {rate:.0f} tok/s"
            )
        if step % 1000 == 0:
            save()
    save()
    held = eval_loss(model, eval_stream, recipe.seq_len, device)
    trn = eval_loss(model, train_stream, recipe.seq_len, device)
    log(f"target: done, train loss {trn:.4f}, held-out loss {held:.4f} nats/token")
    return True


def export_target(
    run_dir: Path, shape: TargetShape, vocab_size: int, eos_id: int, out_dir: Path
) -> None:
    """Write the finished target as a bf16 Hugging Face checkpoint into ``out_dir``."""
    from transformers import LlamaForCausalLM

    st = torch.load(run_dir / "state.pt", map_location="cpu", weights_only=False)
    model = LlamaForCausalLM(shape.llama_config(vocab_size, eos_id))
    model.load_state_dict(st["model"])
    model.to(torch.bfloat16).save_pretrained(str(out_dir))
