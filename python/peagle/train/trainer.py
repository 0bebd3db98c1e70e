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
from peagle.train.corpus import (
    SequenceOrder,
    iter_records,
    token_counts,
    tokenize_documents_with_prompt_lens,
)
from peagle.train.init import drafter_config_for_target, init_drafter, select_draft_vocab
from peagle.train.steps import StepStats, eagle3_sequence_step, peagle_sequence_step
from peagle.train.target_features import (
    pack_sequences,
    prompt_loss_mask,
    shift_sequence,
    target_forward_batch,
)

STATE_NAME = "train_state.pt"
LOG_NAME = "train_log.jsonl"
CALIBRATION_STEPS = 8  # steps timed (after the first) before a time-budgeted run's plan is logged
RATE_WINDOW = 8  # recent steps whose mean duration re-estimates a time-budgeted run's length
# TrainConfig fields that shape the drafter: a resume with other values is refused.
ARCHITECTURE_KEYS = (
    "method", "num_layers", "intermediate_size", "draft_vocab_size", "mask_token_id",
    "aux_layer_ids", "num_depths", "norm_before_residual",
)  # fmt: skip
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
    # at most this many chains (depth >= 1) start per training sequence (speculators'
    # max_anchors; None = every COD chain)
    max_anchors: int | None = None
    # JSONL field with each document's prompt length: labels of prompt tokens carry no loss
    # (None = every label supervised)
    prompt_len_field: str | None = None
    norm_before_residual: bool = False  # the first layer's residual is the normed hidden input
    freeze_lm_head: bool = False  # keep lm_head at its initial value (the target's rows)
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
    time_budget_s: float = 0.0  # revise `steps` as steps are timed so training ends within this
    # the budget counts from the end of the first step (loading and the first step's compilation
    # excluded): equal training time for runs of which only some pay a compile (an ablation's
    # variants in one process); False = from the start, loading included
    time_budget_excludes_startup: bool = False
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

    def __init__(self, cfg: TrainConfig, log=print, clock=time.monotonic) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._clock = clock  # injectable for tests of the time budget
        self._t_created = clock()  # the time limit counts loading too
        self._t_budget0 = self._t_created  # the time budget's start (see TrainConfig)
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

        records = list(iter_records(cfg.data, cfg.data_glob, cfg.jsonl_field, cfg.prompt_len_field))
        texts = [r[0] for r in records]
        self.sequences, self.prompt_lens = tokenize_documents_with_prompt_lens(
            texts, [r[1] for r in records], tokenizer, cfg.seq_len, cfg.min_seq_len
        )
        del records
        self.order = SequenceOrder(len(self.sequences), cfg.seed)
        n_tok = sum(s.numel() for s in self.sequences)
        log(f"data: {len(texts)} documents, {len(self.sequences)} sequences, {n_tok} tokens")
        if cfg.prompt_len_field is not None:
            n_prompt = sum(self.prompt_lens)
            log(f"data: {n_prompt} prompt tokens ({cfg.prompt_len_field!r}) carry no loss")

        state = None
        if (self.out / STATE_NAME).is_file():
            state = torch.load(self.out / STATE_NAME, map_location="cpu", weights_only=False)
            check_resume_architecture(cfg, state, self.out)
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
                norm_before_residual=cfg.norm_before_residual,
            )
            dcfg.raw["peagle_training"] = {
                "method": cfg.method,
                "num_depths": cfg.num_depths,
                "cod_r": cfg.cod_r,
                "cod_r_min": cfg.cod_r_min,
                "max_anchors": cfg.max_anchors,
                "prompt_len_field": cfg.prompt_len_field,
                "freeze_lm_head": cfg.freeze_lm_head,
            }
            self.drafter = init_drafter(
                dcfg, self.target, parallel=parallel, draft_ids=draft_ids, seed=cfg.seed
            )
        self.drafter.to(self.device).train()
        if cfg.freeze_lm_head:
            self.drafter.lm_head.weight.requires_grad_(False)
        if state is not None:
            was = bool((state.get("train_config") or {}).get("freeze_lm_head", False))
            if was != cfg.freeze_lm_head:
                raise ValueError(
                    f"{self.out} was trained with freeze_lm_head={was}; resume it with the same "
                    "setting, or choose a new --output"
                )
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
        # A time-budgeted run revises its step count as it goes; a resumed one keeps the count
        # its budget ended at.
        self._budgeting = cfg.time_budget_s > 0 and self.budgeted_steps is None
        self._max_steps = cfg.steps
        self._save_s = 0.0  # duration of the last checkpoint save (the final one is reserved)
        self._say = log  # messages; routed around the progress bar while it is shown
        self.out.mkdir(parents=True, exist_ok=True)  # only once everything above loaded
        n_par = sum(p.numel() for p in params)
        log(
            f"drafter: {cfg.method}, {self.drafter.config.num_hidden_layers} layers, "
            f"{n_par / 1e6:.2f}M parameters, draft vocab {self.drafter.config.draft_vocab_size}"
        )

    # -- one optimizer step -------------------------------------------------------------------

    def _sequence_step(self, pos: int) -> tuple[StepStats, int]:
        """Forward + backward of sequences ``pos .. pos + pack - 1``, packed into one forward."""
        cfg = self.cfg
        picked = [self.order.index(p)[1] for p in range(pos, pos + cfg.pack)]
        tokens = [self.sequences[si].to(self.device) for si in picked]
        shifted = []
        # one batched target forward per group of equal-length sequences of the pack
        for si, tok, (aux, logits) in zip(
            picked, tokens, target_forward_batch(self.target, tokens, self.aux_ids), strict=True
        ):
            lm = None
            if self.prompt_lens[si] > 0:
                lm = prompt_loss_mask(tok.numel(), self.prompt_lens[si], device=self.device)
            d2t = self.draft_to_target
            shifted.append(shift_sequence(tok, aux, logits, loss_mask=lm, draft_to_target=d2t))
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
            max_anchors=cfg.max_anchors,
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

    def _revise_budgeted_steps(self, recent_step_s: float, announce: bool) -> None:
        """With a time budget: the step count that ends training within it, from the mean
        duration of the recent steps (checkpoint saves and logging included) and the time left,
        reserving one final save. Revised after every step, so steps that slow down (or speed
        up) as training goes do not push the run past the budget."""
        cfg = self.cfg
        if not self._budgeting:
            return
        left = cfg.time_budget_s - (self._clock() - self._t_budget0) - self._save_s
        fit = int(left / max(recent_step_s, 1e-9)) if left > 0 else 0
        steps = max(self.step, min(self._max_steps, self.step + fit))
        if announce:
            self._say(
                f"time budget {cfg.time_budget_s:.0f} s: {recent_step_s * 1e3:.0f} ms/step "
                f"measured, about {steps} steps (of at most {self._max_steps}; revised as it goes)"
            )
        cfg.steps = self.budgeted_steps = steps

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self) -> None:
        cfg = self.cfg
        t0 = self._clock()
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
        self._save_s = self._clock() - t0

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> dict:
        cfg = self.cfg
        clock = self._clock
        t_start = clock()
        bar = None
        if cfg.progress:
            from tqdm.auto import tqdm

            bar = tqdm(
                total=cfg.steps,
                initial=self.step,
                desc=f"peagle train ({cfg.method})",
                unit="step",
                dynamic_ncols=True,
                disable=None,  # none when stderr is not a terminal (a log file)
            )
            if bar.disable:
                bar = None
            else:
                self._say = _around_bar(self.log)
        window, win_tokens, win_t0 = StepStats(), 0, clock()
        last = None
        finished = self.step >= cfg.steps
        # the slowest step of this call but its first (which compiles, loads caches)
        step_s, steps_now = 0.0, 0
        recent: list[float] = []  # durations of the latest steps but the first (budget)
        while self.step < cfg.steps:
            t_step = clock()
            stats, tokens = self.train_step()
            window.merge(stats)
            win_tokens += tokens
            if bar is not None:
                bar.update(1)
            if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                dt = clock() - win_t0
                acc = [c / max(1, n) for c, n in zip(window.correct, window.count, strict=True)]
                last = {
                    "step": self.step,
                    "loss": window.mean_kl,
                    "kl_per_depth": [
                        k / max(1, n) for k, n in zip(window.kl, window.count, strict=True)
                    ],
                    "acc_per_depth": acc,
                    # each depth's share of the summed loss (depth 0's share is what a cap on
                    # chain starts raises)
                    "loss_share_per_depth": [k / max(1e-30, sum(window.kl)) for k in window.kl],
                    "elements_per_depth": list(window.count),
                    "tokens_per_s": win_tokens / max(dt, 1e-9),
                    "lr": self.opt.param_groups[0]["lr"],
                    "elapsed_s": clock() - t_start,
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
                else:  # no bar: the loss goes to the log (stdout), not only train_log.jsonl
                    self.log(
                        f"step {self.step}/{cfg.steps}: loss {window.mean_kl:.4f}, acc0 "
                        + (f"{acc[0]:.3f}" if acc else "-")
                        + f", {last['tokens_per_s']:.0f} tok/s, lr {last['lr']:.2e}, "
                        f"{last['elapsed_s']:.1f} s"
                    )
                window, win_tokens, win_t0 = StepStats(), 0, clock()
            if self.step % cfg.save_every == 0:
                self.save()
            dur = clock() - t_step  # the step with its logging and saving
            if steps_now == 0 and cfg.time_budget_excludes_startup:
                self._t_budget0 = clock()
            if steps_now > 0:
                step_s = max(step_s, dur)
                recent = (recent + [dur])[-RATE_WINDOW:]
                self._revise_budgeted_steps(
                    sum(recent) / len(recent), announce=steps_now == CALIBRATION_STEPS
                )
                if bar is not None:
                    bar.total = cfg.steps
                    bar.refresh()
            steps_now += 1
            # Stop once the limit is passed or the next step would pass it (one step at least).
            if cfg.time_limit_s > 0 and (clock() - self._t_created + step_s > cfg.time_limit_s):
                break
        else:
            finished = True
        if bar is not None:
            bar.close()
        self._say = self.log
        self.save()
        if finished:
            budget = ""
            if self._budgeting:
                used = clock() - self._t_budget0
                since = " after the first step" if cfg.time_budget_excludes_startup else ""
                budget = f" in {used:.0f} s{since} of a {cfg.time_budget_s:.0f} s time budget"
            self.log(f"finished {self.step} steps{budget}; checkpoint in {self.out}")
        else:
            self.log(f"stopped at step {self.step}/{cfg.steps} (time limit); rerun to resume")
        return {"finished": finished, "step": self.step, "last": last}


def _around_bar(log):
    """``log`` that clears the progress bar line first (messages on a line of their own)."""
    from tqdm.auto import tqdm

    def say(msg: str) -> None:
        with tqdm.external_write_mode():
            log(msg)

    return say


def check_resume_architecture(cfg: TrainConfig, state: dict, out: Path) -> None:
    """Refuse to resume ``out`` with architecture settings other than those it was made with
    (keeping the old drafter silently would ignore the new flags). A setting left at None (its
    default, derived from the target) matches whatever the checkpoint has."""
    old_cfg = state.get("train_config") or {}
    d = DrafterConfig.from_dict(state["drafter_config"])
    old = {
        "method": old_cfg.get("method"),
        "num_depths": old_cfg.get("num_depths"),
        "num_layers": d.num_hidden_layers,
        "intermediate_size": d.intermediate_size,
        "draft_vocab_size": d.draft_vocab_size,
        "mask_token_id": d.mask_token_id,
        "aux_layer_ids": d.aux_layer_ids,
        "norm_before_residual": d.norm_before_residual,
    }
    new = {k: getattr(cfg, k) for k in ARCHITECTURE_KEYS}
    if new["num_layers"] is None:
        new["num_layers"] = 4 if cfg.method == "peagle" else 1
    if new["draft_vocab_size"] is not None:
        new["draft_vocab_size"] = min(new["draft_vocab_size"], d.vocab_size)
    differ = [
        k
        for k in ARCHITECTURE_KEYS
        if new[k] is not None and old[k] is not None and _norm(new[k]) != _norm(old[k])
    ]
    if differ:
        what = ", ".join(f"{k}: {old[k]!r} there, {new[k]!r} now" for k in differ)
        raise ValueError(
            f"{out} holds a run with other architecture settings ({what}); pass the same flags "
            "to resume it, or choose a new --output"
        )


def _norm(v):
    return list(v) if isinstance(v, tuple) else v


def train(cfg: TrainConfig, log=print) -> dict:
    """Run (or resume) training; returns ``{"finished", "step", "last"}``."""
    return Trainer(cfg, log).run()
