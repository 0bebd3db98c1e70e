"""The speculative decode loop: schedule -> build inputs -> run -> sync -> apply -> propose.

One :meth:`SpecDecoder.step` runs, for every running request at once:

1. **schedule** (:mod:`~peagle.decode.scheduler`): admission, each request's rows and positions
   (a prefill: its prompt; a decode: last token + ``k`` drafts), KV blocks for them;
2. **build inputs** (:mod:`~peagle.decode.builder`): every input into the staging buffer, ONE
   upload, the previous step's drafts copied into the draft rows (:mod:`~peagle.decode.inputs`);
3. **run** the target pass + ``verify_chain`` (:mod:`~peagle.decode.verify`), replayed from a CUDA
   graph (:mod:`~peagle.decode.cuda_graphs`) for uniform decode steps, else eagerly;
4. **sync** once: the emitted tokens and acceptance counts to the host;
5. **apply** them: tokens appended, stop conditions (EOS / stop ids / ``max_new_tokens`` /
   ``max_model_len``; nothing after a stop is emitted), statistics, finished requests released;
6. **propose** drafts for the requests that will draft again (:mod:`~peagle.decode.proposers`:
   ``peagle`` one parallel drafter pass, ``eagle3`` K serial passes; ``none`` has no drafter).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from peagle.decode.blocks import blocks_for, default_num_blocks
from peagle.decode.builder import InputBuilder
from peagle.decode.config import validate_engine_args
from peagle.decode.cuda_graphs import DecodeGraphs
from peagle.decode.inputs import Batch, StepTensors
from peagle.decode.proposers import PROPOSERS
from peagle.decode.request import Request, RequestOutput, SamplingParams
from peagle.decode.scheduler import Scheduler
from peagle.decode.synthetic import SyntheticAcceptance
from peagle.decode.timing import PhaseClock
from peagle.decode.verify import TargetVerifier
from peagle.models.drafter import Eagle3Drafter
from peagle.models.target import TargetRunner

METHODS = ("peagle", "eagle3", "none")


class SpecDecoder:
    """Batched speculative decoding of a target model with a P-EAGLE / EAGLE-3 drafter.

    Args:
        target: the :class:`TargetRunner`.
        drafter: the :class:`Eagle3Drafter` (None with ``method="none"``).
        method: ``"peagle"`` (one parallel drafter pass), ``"eagle3"`` (K serial passes) or
            ``"none"``.
        num_speculative_tokens: K, the most drafts per step (a request may ask for fewer).
        max_num_seqs: requests decoded together; more wait in a queue.
        max_model_len: prompt + generated tokens per request (default: the target's
            ``max_position_embeddings``).
        block_size: tokens per KV block.
        num_blocks: KV blocks per cache (default: enough for ``max_num_seqs`` requests of
            ``max_model_len`` tokens, capped by ``kv_cache_memory``; requests wait for blocks).
        kv_cache_memory: bytes for the two KV caches when ``num_blocks`` is not given (default:
            70% of the free device memory on CUDA, 1 GiB on CPU).
        eos_token_ids: ids that end a request (unless its ``ignore_eos``).
        cuda_graphs: ``"auto"`` (capture uniform decode steps in CUDA graphs on CUDA, eager on
            CPU or when the target's ``cuda_graph_blocker`` names a reason, e.g. MoE experts
            that sync with the host), ``"on"``, ``"off"``, or ``"emulate"`` (the graphs' padded
            static-buffer path run eagerly, any device: for tests).
        synthetic_acceptance: benchmarks only (default None: off): accept/reject decisions drawn
            from per-position rates (:mod:`~peagle.decode.synthetic`); outputs are not the text.
        max_num_batched_tokens: the most target rows one step runs (running requests' decode rows
            plus the prompts admitted in it); a waiting request is admitted only while its prompt
            fits, except the step's first prompt (prompts are never split: no chunked prefill).
            Default None: every request that has a slot and KV blocks is admitted at once.

    Raises:
        ValueError: unknown method, missing drafter, drafter/target mismatch, a checkpoint that
            cannot draft in parallel for ``method="peagle"``, K < 1 with a drafter.
    """

    def __init__(
        self,
        target: TargetRunner,
        drafter: Eagle3Drafter | None = None,
        *,
        method: str = "peagle",
        num_speculative_tokens: int = 3,
        max_num_seqs: int = 8,
        max_model_len: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        eos_token_ids: Sequence[int] = (),
        cuda_graphs: str = "auto",
        synthetic_acceptance: SyntheticAcceptance | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        validate_engine_args(
            method=method, num_speculative_tokens=num_speculative_tokens, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, block_size=block_size, num_blocks=num_blocks,
            kv_cache_memory=kv_cache_memory, target=target, drafter=drafter,
            max_num_batched_tokens=max_num_batched_tokens,
        )  # fmt: skip
        self.target = target
        self.method = method
        self.device = target.device
        self.vocab_size = target.vocab_size
        limit = int(target.config.max_position_embeddings)
        self.max_model_len = min(int(max_model_len or limit), limit)
        if method == "none":
            self.drafter = None
            self.num_spec_tokens = 0
            self.drafter_max_len = self.max_model_len
        else:
            if drafter is None:
                raise ValueError(f"method {method!r} needs a drafter model")
            if num_speculative_tokens < 1:
                raise ValueError(
                    f"num_speculative_tokens must be >= 1 for method {method!r}, got "
                    f"{num_speculative_tokens}"
                )
            if drafter.device != self.device or drafter.dtype != target.dtype:
                raise ValueError(
                    f"drafter ({drafter.device}, {drafter.dtype}) and target ({self.device}, "
                    f"{target.dtype}) must share device and dtype"
                )
            drafter.check_target(target.hidden_size, target.vocab_size)
            if drafter.config.aux_layer_ids is not None:
                target.set_aux_layer_ids(drafter.config.aux_layer_ids)
            if len(target.aux_layer_ids) != 3:
                raise ValueError(
                    f"the target has {target.num_layers} layers, too few for the EAGLE-3 default "
                    "auxiliary layers [2, L//2, L-3]; the drafter's config must name them "
                    "(eagle_config.eagle_aux_hidden_state_layer_ids)"
                )
            self.drafter = drafter
            self.num_spec_tokens = int(num_speculative_tokens)
            # Positions, not the length budget: drafts near max_model_len stay full K (the
            # commit stops at max_model_len) and their rows fit the reservation (Scheduler).
            self.drafter_max_len = min(limit, int(drafter.config.max_position_embeddings))
            if method == "peagle":
                drafter.check_parallel_drafting()
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        # Widest position any forward touches: max_model_len - 1 plus the drafter's K - 1 mask
        # rows plus its rejected tail (attention reads, never writes, there).
        self.max_blocks_per_seq = blocks_for(
            self.max_model_len + 2 * self.num_spec_tokens + 1, block_size
        )
        if num_blocks is None:
            per_token = target.kv_bytes_per_token()
            if self.drafter is not None:
                per_token += self.drafter.kv_bytes_per_token()
            cap = max_num_seqs * self.max_blocks_per_seq + 1
            num_blocks = default_num_blocks(
                per_token, block_size, cap, self.device, kv_cache_memory
            )
        self.scheduler = Scheduler(
            num_blocks, block_size, max_num_seqs, self.max_model_len, self.drafter_max_len,
            self.num_spec_tokens, self.max_blocks_per_seq, self.vocab_size, eos_token_ids,
            max_num_batched_tokens, position_limit=limit,
        )  # fmt: skip
        self.allocator = self.scheduler.allocator
        self.target_kv = target.make_kv_cache(num_blocks, block_size)
        self.drafter_kv = (
            None if self.drafter is None else self.drafter.make_kv_cache(num_blocks, block_size)
        )
        self.synthetic = synthetic_acceptance if self.drafter is not None else None
        keys = self.synthetic is not None  # synthetic draws are keyed on request ids
        self.inputs = InputBuilder(self.scheduler, self.num_spec_tokens, self.device, keys)
        self.verifier = TargetVerifier(target, self.target_kv, self.synthetic)
        if self.synthetic is not None:
            self.synthetic.rate_tensor(self.num_spec_tokens, self.device)  # now, not in a capture
        self.proposer = None
        if self.drafter is not None:
            self.proposer = PROPOSERS[method](
                self.drafter, self.drafter_kv, self.num_spec_tokens, max_num_seqs, block_size,
                self.drafter_max_len, self.vocab_size,
            )  # fmt: skip
        self._last_drafts: torch.Tensor | None = None
        self._clock = PhaseClock(self.device)
        self.num_steps = 0  # target passes run by step()
        self.num_graph_steps = 0  # of them, replayed from a CUDA graph (the rest ran eagerly)
        if cuda_graphs not in ("auto", "on", "off", "emulate"):
            raise ValueError(f"cuda_graphs must be auto/on/off/emulate, got {cuda_graphs!r}")
        if cuda_graphs == "on" and self.device.type != "cuda":
            raise ValueError("cuda_graphs='on' needs a CUDA target")
        blocker = getattr(target, "cuda_graph_blocker", None)
        if cuda_graphs == "on" and blocker is not None:
            raise ValueError(f"cuda_graphs='on' cannot capture this target: {blocker}")
        if cuda_graphs == "auto" and blocker is not None:
            cuda_graphs = "off"  # e.g. MoE experts that sync with the host: run eagerly
        self.graphs = None
        if cuda_graphs == "emulate" or (cuda_graphs != "off" and self.device.type == "cuda"):
            self.graphs = DecodeGraphs(
                self.inputs.staging, self.num_spec_tokens, max_num_seqs, self.verifier,
                None if self.proposer is None else self.proposer.propose,
                capture=cuda_graphs != "emulate",
            )  # fmt: skip

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self):
        return self.scheduler.running

    # ------------------------------------------------------------------------------------------
    # Public API
    # ------------------------------------------------------------------------------------------

    def add_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None
    ) -> int:
        """Queue a request; returns its id. Raises ``ValueError`` on a bad prompt or K."""
        rid = self.scheduler.add_request(prompt_token_ids, params)
        self.scheduler.waiting[-1].stats.synthetic_acceptance = self.synthetic is not None
        return rid

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_finish: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Run ``prompts`` (token ids) to completion; outputs in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        done: dict[int, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                done[out.request_id] = out
                if on_finish is not None:
                    on_finish(out)
        return [done[i] for i in ids]

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One target pass + verification + drafting for every running request; returns the
        requests that finished."""
        sched = self.scheduler.schedule()
        if sched is None:
            return []
        b_pad = None if self.graphs is None else self.graphs.pad_size(sched.num_drafts, sched.qlens)
        if b_pad is not None:
            self.graphs.prepare(b_pad)  # capture (resets the static buffers) before the upload
        batch = self.inputs.build(sched, b_pad, self._last_drafts)
        self.num_steps += 1
        self.num_graph_steps += b_pad is not None

        t0 = self._clock.start()
        if b_pad is not None:
            out_tokens, num_accepted, aux = self.graphs.target_and_verify(batch)
        else:
            out_tokens, num_accepted, aux = self.verifier(batch.tensors, self.num_spec_tokens)
        out_host = out_tokens.cpu()  # the loop's one host sync per step
        acc_host = num_accepted.cpu()
        self._clock.stop(t0, batch.reqs, "target_time_s")
        self._clock.resolve()

        finished = self._apply_outputs(batch, out_host, acc_host)
        drafting = [
            r.finish_reason is None and self.scheduler.num_drafts(r) > 0 for r in batch.reqs
        ]
        if self.proposer is not None and any(drafting):
            t1 = self._clock.start()
            self._propose(batch, out_tokens, aux, drafting)
            drafted = [r for r, d in zip(batch.reqs, drafting, strict=True) if d]
            self._clock.stop(t1, drafted, "drafter_time_s")
        for r, d in zip(batch.reqs, drafting, strict=True):
            if not d:
                r.draft_row = None
        self.scheduler.finish(finished)
        return [r.output() for r in finished]

    def _apply_outputs(self, batch: Batch, out: torch.Tensor, acc: torch.Tensor) -> list[Request]:
        """Commit each request's emitted tokens (``out`` / ``acc`` on the host); the finished."""
        batch.accepted = [int(a) for a in acc.tolist()]
        return [
            r
            for i, r in enumerate(batch.reqs)
            if r.commit(out[i].tolist(), batch.num_drafts[i], batch.accepted[i], self.max_model_len)
        ]

    def _propose(self, batch: Batch, out_tokens: torch.Tensor, aux: torch.Tensor, drafting) -> None:
        """Drafts for the requests with ``drafting[i]``; the others become padding requests of the
        drafter batch (inert rows, no KV writes, block table never read)."""
        self.scheduler.ensure_draft_positions(batch, drafting)
        self.inputs.upload_drafter(batch, drafting)
        if batch.b_pad is not None:
            drafts = self.graphs.draft(batch, out_tokens, aux)
        else:
            drafts = self.proposer.propose(batch.tensors, out_tokens, aux)
        self._last_drafts = drafts
        for i, r in enumerate(batch.reqs):
            r.draft_row = i if drafting[i] else None

    # The two phases on given inputs (graph-capturable; benchmarks time them one by one).

    def target_and_verify_eager(self, t: StepTensors, max_num_drafts: int):
        """Target forward over ``t`` and verification; returns ``(output_token_ids [B, K+1],
        num_accepted [B], aux_hidden [T, 3H])`` on the device."""
        return self.verifier(t, max_num_drafts)

    def draft_eager(self, t: StepTensors, out_tokens: torch.Tensor, aux: torch.Tensor):
        """Drafter phase over ``t`` (after verification); drafts ``[B, K]`` int32 target ids."""
        return self.proposer.propose(t, out_tokens, aux)
