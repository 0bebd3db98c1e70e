"""The ``peagle train`` loop: data, target features, COD, steps, optimiser, checkpoints, resume.

Output directory layout:

* ``config.json`` + ``model.safetensors`` — the drafter in the released format (SPEC.md §2.4),
  written through :meth:`Eagle3Drafter.save_pretrained` at every save (``--save-dtype``);
* ``train_state.pt`` — float32 weights, optimiser, step, data position, settings (resume);
* ``train_log.jsonl`` — one line per logging interval (loss, per-depth accuracy, tokens/s).
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from peagle.models.drafter import SAVE_FORMATS, Eagle3Drafter
from peagle.models.drafter_config import DrafterConfig
from peagle.train.attention import MaskedAttention
from peagle.train.cod import cod_sample
from peagle.train.corpus import SequenceOrder, iter_documents, token_counts, tokenize_documents
from peagle.train.init import drafter_config_for_target, init_drafter, select_draft_vocab
from peagle.train.steps import StepStats, eagle3_sequence_step, peagle_sequence_step
from peagle.train.target_features import pack_sequences, shift_sequence, target_forward

STATE_NAME = "train_state.pt"
LOG_NAME = "train_log.jsonl"
CALIBRATION_STEPS = 8  # steps timed (after the first) to fix a time-budgeted run's length
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class TrainConfig:
    target: str
    data: list[str]
    output: str
    method: str = "peagle"  # or "eagle3"
    tokenizer: str | None = None
    data_glob: str = "*"
    jsonl_field: str = "text"
    num_layers: int | None = None  # default: 4 (peagle), 1 (eagle3)
    intermediate_size: int | None = None
    draft_vocab_size: int | None = None
    mask_token_id: int | None = None
    aux_layer_ids: list[int] | None = None
    num_depths: int = 8  # K: trained parallel depth (peagle) / TTT passes (eagle3)
    cod_r: float = 0.7
    cod_r_min: float = 0.2
    partitions: int = 1
    seq_len: int = 2048
    min_seq_len: int = 16
    steps: int = 1000
    grad_accum: int = 1
    pack: int = 1  # sequences packed into one forward (separate documents)
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    attention: str = "auto"
    attention_chunk: int = 1024
    device: str | None = None
    target_dtype: str = "auto"
    save_dtype: str = "bfloat16"
    export_format: str = "eagle3"  # or "speculators" (Eagle3Drafter.save_pretrained's format)
    autocast: bool | None = None  # default: on for CUDA
    save_every: int = 200
    log_every: int = 10
    time_limit_s: float = 0.0
    time_budget_s: float = 0.0  # fix `steps` after calibration so training ends within this
    seed: int = 0
    progress: bool = True
    extra: dict = field(default_factory=dict)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


def _resolve_mask_id(cfg: TrainConfig, tokenizer, vocab_size: int) -> int:
    if cfg.mask_token_id is not None:
        mid = cfg.mask_token_id
    elif getattr(tokenizer, "mask_token_id", None) is not None:
        mid = tokenizer.mask_token_id
    else:
        mid = (
            tokenizer.convert_tokens_to_ids("<|mask|>")
            if "<|mask|>" in tokenizer.get_vocab()
            else None
        )
    if mid is None:
        raise ValueError(
            "P-EAGLE needs a mask token id: pass --mask-token-id (an id the target never sees in "
            "text, e.g. a reserved special token)"
        )
    if not 0 <= mid < vocab_size:
        raise ValueError(f"mask token id {mid} is outside the target vocabulary [0, {vocab_size})")
    return int(mid)


class Trainer:
    """Holds the target, the drafter, the data and the optimiser of one ``peagle train`` run."""

    def __init__(self, cfg: TrainConfig, log=print) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._t_created = time.monotonic()  # the time limit counts loading too
        if cfg.method not in ("peagle", "eagle3"):
            raise ValueError(f"method must be 'peagle' or 'eagle3', got {cfg.method!r}")
        if cfg.method == "eagle3" and cfg.partitions != 1:
            raise ValueError("sequence partitioning applies to P-EAGLE only (use --partitions 1)")
        if min(cfg.num_depths, cfg.partitions, cfg.grad_accum, cfg.pack, cfg.steps) < 1:
            raise ValueError("num_depths, partitions, grad_accum, pack and steps must be >= 1")
        if cfg.export_format not in SAVE_FORMATS:
            raise ValueError(f"export_format {cfg.export_format!r} not in {SAVE_FORMATS}")
        if cfg.time_budget_s < 0:
            raise ValueError(f"time_budget_s must be >= 0, got {cfg.time_budget_s}")
        self.cfg = cfg
        self.log = log
        self.out = Path(cfg.output)
        self.out.mkdir(parents=True, exist_ok=True)
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        use_autocast = cfg.autocast if cfg.autocast is not None else self.device.type == "cuda"
        self.autocast_dtype = torch.bfloat16 if use_autocast else None
        tdtype = cfg.target_dtype
        if tdtype == "auto":
            tdtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.target = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=_DTYPES[tdtype])
        self.target.to(self.device).eval().requires_grad_(False)
        tcfg = self.target.config
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.target)

        texts = list(iter_documents(cfg.data, cfg.data_glob, cfg.jsonl_field))
        self.sequences = tokenize_documents(texts, tokenizer, cfg.seq_len, cfg.min_seq_len)
        self.order = SequenceOrder(len(self.sequences), cfg.seed)
        n_tok = sum(s.numel() for s in self.sequences)
        log(f"data: {len(texts)} documents, {len(self.sequences)} sequences, {n_tok} tokens")

        state = None
        if (self.out / STATE_NAME).is_file():
            state = torch.load(self.out / STATE_NAME, map_location="cpu", weights_only=False)
            dcfg = DrafterConfig.from_dict(state["drafter_config"])
            parallel = state["parallel"]
            self.drafter = Eagle3Drafter(
                dcfg, with_mask_hidden=parallel, with_t2d=state["with_t2d"]
            )
            self.drafter.load_state_dict(state["model"])
            fixed = state.get("budgeted_steps")
            if fixed is not None:  # a time-budgeted run keeps the step count it calibrated
                cfg.steps = fixed
            log(f"resuming {self.out} at step {state['step']}/{cfg.steps}")
        else:
            v = tcfg.vocab_size
            draft_ids = None
            if cfg.draft_vocab_size is not None and cfg.draft_vocab_size < v:
                draft_ids = select_draft_vocab(
                    token_counts(self.sequences, v), cfg.draft_vocab_size
                )
            parallel = cfg.method == "peagle"
            dcfg = drafter_config_for_target(
                tcfg,
                num_layers=cfg.num_layers or (4 if parallel else 1),
                intermediate_size=cfg.intermediate_size,
                draft_vocab_size=None if draft_ids is None else draft_ids.numel(),
                mask_token_id=_resolve_mask_id(cfg, tokenizer, v) if parallel else None,
                aux_layer_ids=cfg.aux_layer_ids,
            )
            dcfg.raw["peagle_training"] = {
                "method": cfg.method,
                "num_depths": cfg.num_depths,
                "cod_r": cfg.cod_r,
                "cod_r_min": cfg.cod_r_min,
            }
            self.drafter = init_drafter(
                dcfg, self.target, parallel=parallel, draft_ids=draft_ids, seed=cfg.seed
            )
        self.drafter.to(self.device).train()
        self.aux_ids = self.drafter.config.aux_layer_ids
        self.draft_to_target = None
        if self.drafter.config.draft_vocab_size != self.drafter.config.vocab_size:
            v_d = self.drafter.config.draft_vocab_size
            self.draft_to_target = torch.arange(v_d, device=self.device) + self.drafter.d2t
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(
            params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
        )
        self.step = 0
        self.position = 0  # sequences consumed
        self.budgeted_steps = None if state is None else state.get("budgeted_steps")
        if state is not None:
            self.opt.load_state_dict(state["optimizer"])
            self.step = state["step"]
            self.position = state["position"]
        self.attention = MaskedAttention(cfg.attention, cfg.attention_chunk)
        n_par = sum(p.numel() for p in params)
        log(
            f"drafter: {cfg.method}, {self.drafter.config.num_hidden_layers} layers, "
            f"{n_par / 1e6:.2f}M parameters, draft vocab {self.drafter.config.draft_vocab_size}"
        )

    # -- one optimizer step -------------------------------------------------------------------

    def _sequence_step(self, pos: int) -> tuple[StepStats, int]:
        """Forward + backward of sequences ``pos .. pos + pack - 1``, packed into one forward."""
        cfg = self.cfg
        shifted = []
        for p in range(pos, pos + cfg.pack):
            _, si = self.order.index(p)
            tokens = self.sequences[si].to(self.device)
            aux, logits = target_forward(self.target, tokens, self.aux_ids)
            d2t = self.draft_to_target
            shifted.append(shift_sequence(tokens, aux, logits, draft_to_target=d2t))
        seq = pack_sequences(shifted)
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + pos)
        elems = cod_sample(
            seq.n,
            cfg.num_depths,
            cfg.cod_r,
            cfg.cod_r_min,
            loss_mask=seq.loss_mask.cpu(),
            doc_ids=seq.doc_ids.cpu(),
            generator=gen,
        )
        kw = dict(
            attention=self.attention,
            autocast_dtype=self.autocast_dtype,
            loss_scale=1.0 / cfg.grad_accum,
        )
        if cfg.method == "peagle":
            st = peagle_sequence_step(self.drafter, seq, elems, num_partitions=cfg.partitions, **kw)
        else:
            st = eagle3_sequence_step(self.drafter, seq, elems, **kw)
        return st, seq.n

    def train_step(self) -> tuple[StepStats, int]:
        cfg = self.cfg
        for g in self.opt.param_groups:
            g["lr"] = cfg.lr * lr_factor(self.step, cfg)
        stats, tokens = StepStats(), 0
        for _ in range(cfg.grad_accum):
            st, n = self._sequence_step(self.position)
            self.position += cfg.pack
            stats.merge(st)
            tokens += n
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return stats, tokens

    def _fix_budgeted_steps(self, step_s: float) -> None:
        """With a time budget: the step count that ends training within it, from the measured
        time per step (fixed once, before warmup ends; stored in the checkpoint for resumes)."""
        cfg = self.cfg
        if cfg.time_budget_s <= 0 or self.budgeted_steps is not None:
            return
        left = cfg.time_budget_s - (time.monotonic() - self._t_created)
        steps = max(self.step + 1, min(cfg.steps, self.step + int(left / max(step_s, 1e-9))))
        self.log(
            f"time budget {cfg.time_budget_s:.0f} s: {step_s * 1e3:.0f} ms/step measured, "
            f"training {steps} steps (of at most {cfg.steps})"
        )
        cfg.steps = self.budgeted_steps = steps

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self) -> None:
        cfg = self.cfg
        export = copy.deepcopy(self.drafter).to(_DTYPES[cfg.save_dtype])
        export.save_pretrained(
            self.out,
            format=cfg.export_format,
            speculative_tokens=cfg.num_depths,
            verifier_name_or_path=cfg.target,
            verifier_architectures=list(getattr(self.target.config, "architectures", None) or []),
        )
        state = {
            "model": {k: v.detach().cpu() for k, v in self.drafter.state_dict().items()},
            "optimizer": self.opt.state_dict(),
            "step": self.step,
            "position": self.position,
            "drafter_config": self.drafter.config.to_dict(),
            "parallel": self.drafter.mask_hidden is not None,
            "with_t2d": self.drafter.t2d is not None,
            "train_config": asdict(cfg),
            "budgeted_steps": self.budgeted_steps,
        }
        tmp = self.out / (STATE_NAME + ".tmp")
        torch.save(state, tmp)
        tmp.replace(self.out / STATE_NAME)

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> dict:
        cfg = self.cfg
        t_start = time.monotonic()
        bar = None
        if cfg.progress:
            from tqdm.auto import tqdm

            bar = tqdm(
                total=cfg.steps,
                initial=self.step,
                desc=f"peagle train ({cfg.method})",
                unit="step",
                dynamic_ncols=True,
            )
        window, win_tokens, win_t0 = StepStats(), 0, time.monotonic()
        last = None
        finished = self.step >= cfg.steps
        # the slowest step of this call but its first (which compiles, loads caches)
        step_s, steps_now = 0.0, 0
        while self.step < cfg.steps:
            t_step = time.monotonic()
            stats, tokens = self.train_step()
            if steps_now > 0:
                step_s = max(step_s, time.monotonic() - t_step)
            steps_now += 1
            if steps_now == 1:
                t_calib = time.monotonic()  # after the first (compiling) step
            elif steps_now == CALIBRATION_STEPS + 1:
                self._fix_budgeted_steps((time.monotonic() - t_calib) / CALIBRATION_STEPS)
                if bar is not None:
                    bar.total = cfg.steps
            window.merge(stats)
            win_tokens += tokens
            if bar is not None:
                bar.update(1)
            if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                dt = time.monotonic() - win_t0
                acc = [c / max(1, n) for c, n in zip(window.correct, window.count, strict=True)]
                last = {
                    "step": self.step,
                    "loss": window.mean_kl,
                    "kl_per_depth": [
                        k / max(1, n) for k, n in zip(window.kl, window.count, strict=True)
                    ],
                    "acc_per_depth": acc,
                    "tokens_per_s": win_tokens / max(dt, 1e-9),
                    "lr": self.opt.param_groups[0]["lr"],
                    "elapsed_s": time.monotonic() - t_start,
                    "position": self.position,
                }
                with open(self.out / LOG_NAME, "a") as f:
                    f.write(json.dumps(last) + "\n")
                if bar is not None:
                    bar.set_postfix(
                        loss=f"{window.mean_kl:.3f}",
                        acc0=f"{acc[0]:.2f}" if acc else "-",
                        tok_s=f"{last['tokens_per_s']:.0f}",
                    )
                window, win_tokens, win_t0 = StepStats(), 0, time.monotonic()
            if self.step % cfg.save_every == 0:
                self.save()
            # Stop once the limit is passed or the next step would pass it (one step at least).
            if cfg.time_limit_s > 0 and (
                time.monotonic() - self._t_created + step_s > cfg.time_limit_s
            ):
                break
        else:
            finished = True
        if bar is not None:
            bar.close()
        self.save()
        if finished:
            self.log(f"finished {self.step} steps; checkpoint in {self.out}")
        else:
            self.log(f"stopped at step {self.step}/{cfg.steps} (time limit); rerun to resume")
        return {"finished": finished, "step": self.step, "last": last}


def train(cfg: TrainConfig, log=print) -> dict:
    """Run (or resume) training; returns ``{"finished", "step", "last"}``."""
    return Trainer(cfg, log).run()
