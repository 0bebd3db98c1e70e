"""The speculative decode loop: prefill -> draft -> verify -> KV bookkeeping -> repeat.

One :meth:`SpecDecoder.step` runs, for every running request at once:

1. **Target pass** over a ragged batch: a new request contributes its prompt (prefill); a running
   one its last emitted token plus ``k`` drafts (``k`` capped by the remaining token budget and
   context, EDGE_CASES E2). The target writes K/V for all these rows; K/V of rows past the
   acceptance point is simply overwritten by the next step (the next step's rows start right
   after the last accepted token).
2. **Verification** with ``peagle.verify_chain`` over the rows' logits (a request owns its ``k``
   draft rows then its bonus row; a prefill owns only its last row and samples one token).
3. **Host bookkeeping**: emitted tokens are appended, stop conditions applied (EOS / stop ids /
   ``max_new_tokens`` / ``max_model_len``; nothing after a stop is emitted), statistics recorded,
   finished requests release their blocks.
4. **Drafting** for requests that will draft again:
   * ``peagle``: ``fc`` over the target's auxiliary hidden states, then ONE drafter pass over the
     batch built by ``peagle.prepare_draft_inputs`` (``[accepted | NTP | K-1 mask | rejected]``
     per request; rejected rows get slot -1 so they never write KV, EDGE C3), K drafts per
     request from the NTP and mask rows.
   * ``eagle3``: the same op with one slot (no mask rows) gives the first draft, then K-1
     sequential one-row passes feed back the drafter's pre-norm output.
   * ``none``: no drafter; every step emits one token.

KV blocks are allocated right before the forward that writes them (allocated == written, EDGE C7)
from a per-request reservation made at admission. Target and drafter caches share block ids.
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from peagle import ops
from peagle.decode.blocks import BlockAllocator, blocks_for
from peagle.decode.config import validate_engine_args
from peagle.decode.request import Request, RequestOutput, SamplingParams
from peagle.decode.staging import StepStaging
from peagle.decode.timing import PhaseClock
from peagle.models.drafter import Eagle3Drafter
from peagle.models.paged import NULL_BLOCK_ID, AttentionMetadata
from peagle.models.target import TargetRunner

METHODS = ("peagle", "eagle3", "none")


@dataclass
class StepTensors:
    """Device inputs of one step (the static buffers of a CUDA graph have the same fields).

    In the decode loop these are views into the engine's :class:`StepStaging` device buffer
    (shared between steps of the same shape: never rebind a field, write through the staging)."""

    input_ids: torch.Tensor  # [T] int32 target rows
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32 target KV length after this step's rows
    block_table: torch.Tensor  # [B, W] int32 (null-block padded)
    logits_indices: torch.Tensor  # [R] int64 rows verified (R = T_drafts + B)
    draft_row_indices: torch.Tensor  # [T_drafts] int64 rows of input_ids holding drafts
    cu_num_draft_tokens: torch.Tensor  # [B] int32 inclusive
    temperature: torch.Tensor  # [B] fp32
    top_k: torch.Tensor | None  # [B] int32
    top_p: torch.Tensor | None  # [B] fp32
    seeds: torch.Tensor  # [B] int64
    offsets: torch.Tensor  # [B] int64
    request_mask: torch.Tensor | None  # [B] bool (CUDA-graph padding requests are False)
    backup_next_token_ids: torch.Tensor  # [B] int32 (each request's last known token)
    drafter_seq_lens: torch.Tensor  # [B] int32 seq_lens, 0 for requests not drafted this step
    max_query_len: int


@dataclass
class _Batch:
    reqs: list[Request]
    num_drafts: list[int]
    first_pos: list[int]
    qlens: list[int]
    tensors: StepTensors
    staging: StepStaging
    b_pad: int | None = None  # CUDA-graph batch size (None: eager step)
    accepted: list[int] | None = None  # set after verification


@dataclass(frozen=True)
class _RowLayout:
    """Index arrays of a step's row layout that depend only on each request's row and draft
    counts (cached: steady decode steps repeat the same layout). Read-only."""

    qlens: np.ndarray  # [B] rows per request
    qsl: np.ndarray  # [B+1]
    row_req: np.ndarray  # [T] request of each row
    within: np.ndarray  # [T] row index within its request
    logits_indices: np.ndarray  # [R] each request's k draft rows + bonus row
    draft_row_indices: np.ndarray  # [D] rows holding drafts
    cu_num_draft_tokens: np.ndarray  # [B]
    draft_req: np.ndarray  # [D_real] request of each real draft row
    draft_j: np.ndarray  # [D_real] draft position within its request
    num_tokens: int
    num_logits: int
    num_draft_rows: int
    real_rows: int  # rows of the first ``num_real`` requests
    real_drafts: int


@functools.lru_cache(maxsize=64)
def _row_layout(qlens: tuple, ks: tuple, num_real: int) -> _RowLayout:
    ql = np.array(qlens, dtype=np.int64)
    k = np.array(ks, dtype=np.int64)
    qsl = np.zeros(len(ql) + 1, dtype=np.int64)
    np.cumsum(ql, out=qsl[1:])
    t = int(qsl[-1])
    row_req = np.repeat(np.arange(len(ql)), ql)
    nl = k + 1
    cum_nl, cum_k = np.cumsum(nl), np.cumsum(k)
    r, d = int(cum_nl[-1]), int(cum_k[-1])
    real_drafts = int(cum_k[num_real - 1])
    kb = k[:num_real]
    out = _RowLayout(
        qlens=ql, qsl=qsl, row_req=row_req,
        within=np.arange(t) - qsl[row_req],
        logits_indices=np.arange(r) + np.repeat(qsl[1:] - nl - (cum_nl - nl), nl),
        draft_row_indices=np.arange(d) + np.repeat(qsl[:-1] + 1 - (cum_k - k), k),
        cu_num_draft_tokens=cum_k,
        draft_req=np.repeat(np.arange(num_real), kb),
        draft_j=np.arange(real_drafts) - np.repeat(cum_k[:num_real] - kb, kb),
        num_tokens=t, num_logits=r, num_draft_rows=d, real_rows=int(qsl[num_real]),
        real_drafts=real_drafts,
    )  # fmt: skip
    for a in vars(out).values():
        if isinstance(a, np.ndarray):
            a.flags.writeable = False
    return out


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
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        validate_engine_args(
            method=method, num_speculative_tokens=num_speculative_tokens, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, block_size=block_size, num_blocks=num_blocks,
            kv_cache_memory=kv_cache_memory,
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
            self.drafter_max_len = min(
                self.max_model_len, int(drafter.config.max_position_embeddings)
            )
            if method == "peagle":
                drafter.check_parallel_drafting()
                self.mask_token_id = int(drafter.config.mask_token_id)
                self.mask_vector = drafter.mask_vector().to(drafter.dtype)
            else:
                self.mask_token_id = 0
                self.mask_vector = torch.zeros(
                    drafter.config.hidden_size, dtype=drafter.dtype, device=self.device
                )
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        # Widest position any forward touches: max_model_len - 1 plus the drafter's K - 1 mask
        # rows plus its rejected tail (attention reads, never writes, there).
        self.max_blocks_per_seq = blocks_for(
            self.max_model_len + 2 * self.num_spec_tokens + 1, block_size
        )
        if num_blocks is None:
            num_blocks = self._default_num_blocks(kv_cache_memory)
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.target_kv = target.make_kv_cache(num_blocks, block_size)
        self.drafter_kv = (
            None if self.drafter is None else self.drafter.make_kv_cache(num_blocks, block_size)
        )
        # Every small per-step input goes through one staging buffer (one upload per phase); steps
        # with more rows than the graphs' layout (prefills) use a second one grown on demand.
        self._staging = StepStaging(
            max(max_num_seqs * (self.num_spec_tokens + 1), 256), max_num_seqs,
            self.max_blocks_per_seq, self.device,
        )  # fmt: skip
        self._staging_big: StepStaging | None = None
        self._no_discard = torch.zeros(max_num_seqs, dtype=torch.bool, device=self.device)
        self._arange_i32 = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=self.device)
        # Draft-step output buffers by (B, rows, hidden dtype): the short op call, no per-step
        # allocation (a few shapes recur in decode; bounded for ragged prefill mixes).
        self._draft_workspaces: OrderedDict[tuple, ops.DraftInputsWorkspace] = OrderedDict()
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._last_drafts: torch.Tensor | None = None
        self._next_id = 0
        self._clock = PhaseClock(self.device)
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
            from peagle.decode.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, capture=cuda_graphs != "emulate")

    # ------------------------------------------------------------------------------------------
    # Public API
    # ------------------------------------------------------------------------------------------

    def add_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None
    ) -> int:
        """Queue a request; returns its id. Raises ``ValueError`` on a bad prompt or K."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("empty prompt: a request needs at least one token")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens leaves no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        k = (
            self.num_spec_tokens
            if params.num_speculative_tokens is None
            else params.num_speculative_tokens
        )
        if k > self.num_spec_tokens:
            raise ValueError(
                f"request asks for {k} speculative tokens, the engine drafts at most "
                f"{self.num_spec_tokens}"
            )
        for t in params.stop_token_ids:
            if not 0 <= int(t) < self.vocab_size:
                raise ValueError(f"stop token id {t} is outside [0, {self.vocab_size})")
        stop = set(int(t) for t in params.stop_token_ids)
        if not params.ignore_eos:
            stop |= self.eos_token_ids
        req = Request(
            request_id=self._next_id,
            prompt_token_ids=prompt,
            params=params,
            num_spec_tokens=k,
            seed=params.seed if params.seed is not None else Request.new_seed(),
            stop_ids=frozenset(stop),
        )
        self._next_id += 1
        self.waiting.append(req)
        return req.request_id

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

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
        self._admit()
        if not self.running:
            return []
        batch = self._build_batch(self.running)
        t0 = self._clock.start()
        out_tokens, num_accepted, aux = self._target_and_verify(batch)
        out_host = out_tokens.cpu()  # the loop's one host sync per step
        acc_host = num_accepted.cpu()
        self._clock.stop(t0, batch.reqs, "target_time_s")
        self._clock.resolve()

        finished = self._apply_outputs(batch, out_host, acc_host)
        drafting = [r.finish_reason is None and self._num_drafts(r) > 0 for r in batch.reqs]
        if self.drafter is not None and any(drafting):
            t1 = self._clock.start()
            self._draft(batch, out_tokens, aux, drafting)
            drafted = [r for r, d in zip(batch.reqs, drafting, strict=True) if d]
            self._clock.stop(t1, drafted, "drafter_time_s")
        for r, d in zip(batch.reqs, drafting, strict=True):
            if not d:
                r.draft_row = None
        outputs = []
        for r in finished:
            self._release(r)
            r.stats.wall_time_s = time.perf_counter() - r.start_time
            outputs.append(r.output())
        self.running = [r for r in self.running if r.finish_reason is None]
        return outputs

    # ------------------------------------------------------------------------------------------
    # Scheduling and blocks
    # ------------------------------------------------------------------------------------------

    def _max_positions(self, req: Request) -> int:
        """Positions the request may ever write: its longest sequence plus the drafter's
        ``K - 1`` provisional mask positions."""
        longest = min(len(req.prompt_token_ids) + req.params.max_new_tokens, self.max_model_len)
        return longest + max(self.num_spec_tokens - 1, 0)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            need = blocks_for(self._max_positions(req), self.block_size)
            if not self.allocator.reserve(need):
                if not self.running:
                    raise RuntimeError(
                        f"request {req.request_id} needs {need} KV blocks but the cache has only "
                        f"{self.allocator.num_free} free; raise num_blocks or lower max_new_tokens"
                    )
                return
            req.reserved_blocks = need
            req.start_time = time.perf_counter()
            self.waiting.popleft()
            self.running.append(req)

    def _ensure_positions(self, req: Request, num_positions: int) -> None:
        """Allocate blocks so that positions ``[0, num_positions)`` have slots."""
        n = blocks_for(num_positions, self.block_size) - len(req.blocks)
        if n > 0:
            assert n <= req.reserved_blocks, (req.request_id, n, req.reserved_blocks)
            req.blocks += self.allocator.allocate(n)
            req.reserved_blocks -= n

    def _release(self, req: Request) -> None:
        self.allocator.free(req.blocks)
        self.allocator.unreserve(req.reserved_blocks)
        req.blocks = []
        req.reserved_blocks = 0

    def _default_num_blocks(self, budget: int | None) -> int:
        per_token = self.target.kv_bytes_per_token()
        if self.drafter is not None:
            per_token += self.drafter.kv_bytes_per_token()
        if budget is None:
            if self.device.type == "cuda":
                budget = int(0.7 * torch.cuda.mem_get_info(self.device)[0])
            else:
                budget = 1 << 30
        fits = budget // (per_token * self.block_size)
        return int(max(2, min(self.max_num_seqs * self.max_blocks_per_seq + 1, fits)))

    def _table_width(self, reqs: Sequence[Request]) -> int:
        """Block-table columns the batch can touch: each request's reservation plus the K + 1
        positions the drafter's rejected tail may read past it (padded with the null block)."""
        extra = self.num_spec_tokens + 1
        width = max(blocks_for(self._max_positions(r) + extra, self.block_size) for r in reqs)
        return min(width, self.max_blocks_per_seq)

    @staticmethod
    def _fill_block_table(table: np.ndarray, reqs: Sequence[Request]) -> None:
        """Rows of ``table`` (host ``[>= len(reqs), W]``) for ``reqs``, null-block padded."""
        table[: len(reqs)] = NULL_BLOCK_ID
        for i, r in enumerate(reqs):
            if r.blocks:
                table[i, : len(r.blocks)] = r.blocks

    def _staging_for(self, num_tokens: int) -> StepStaging:
        if num_tokens <= self._staging.rows:
            return self._staging
        big = self._staging_big
        if big is None or big.rows < num_tokens:
            rows = 1 << (num_tokens - 1).bit_length()
            big = StepStaging(rows, self.max_num_seqs, self.max_blocks_per_seq, self.device)
            self._staging_big = big
        return big

    def _num_drafts(self, req: Request) -> int:
        """Drafts the request's next verification may carry (EDGE E2: never more than the
        remaining budget minus the bonus token, nor past ``max_model_len`` or the drafter's
        position limit, EDGE C6). Non-increasing as the request grows."""
        if self.drafter is None or req.num_spec_tokens == 0 or not req.prefilled:
            return 0
        n = req.num_tokens
        remaining = req.params.max_new_tokens - len(req.output_token_ids)
        k = min(
            req.num_spec_tokens,
            remaining - 1,
            self.max_model_len - n - 1,
            self.drafter_max_len - n + 1,
        )
        return max(k, 0)

    # ------------------------------------------------------------------------------------------
    # Target pass and verification
    # ------------------------------------------------------------------------------------------

    def _build_batch(self, reqs: list[Request]) -> _Batch:
        """Lay out the step's target rows (a prefill: its prompt; a decode: last token + k draft
        rows), write every input into the host staging buffer (numpy), upload it once and fill
        the draft rows from the previous step's drafts on the device."""
        s = self.num_spec_tokens
        num_drafts: list[int] = []
        first_pos: list[int] = []
        qlens: list[int] = []
        prefills: list[int] = []
        for i, r in enumerate(reqs):
            if not r.prefilled:
                p0, k, n = 0, 0, len(r.prompt_token_ids)
                prefills.append(i)
            else:
                k = self._num_drafts(r) if r.draft_row is not None else 0
                p0, n = r.num_tokens - 1, k + 1
            self._ensure_positions(r, p0 + n)
            num_drafts.append(k)
            first_pos.append(p0)
            qlens.append(n)
        b = len(reqs)
        b_pad = None if self.graphs is None else self.graphs.pad_size(num_drafts, qlens)
        if b_pad is not None:
            self.graphs.prepare(b_pad)  # capture (resets the static buffers) before the upload
        # Padding requests of a graph step: K drafts each, like the real ones, but inert.
        nb = b if b_pad is None else b_pad
        lay = _row_layout(
            tuple(qlens) + (s + 1,) * (nb - b), tuple(num_drafts) + (s,) * (nb - b), b
        )
        num_tokens = lay.num_tokens
        staging = self._staging_for(num_tokens)
        width = staging.table_width if b_pad is not None else self._table_width(reqs)
        h = staging.host()  # waits until the previous upload has been read (CUDA)

        table = h["block_table"][: nb * width].reshape(nb, width)
        self._fill_block_table(table, reqs)
        p0 = np.zeros(nb, dtype=np.int64)
        p0[:b] = first_pos
        pos = h["positions"][:num_tokens]
        np.add(lay.within, p0[lay.row_req], out=pos)
        bs = self.block_size
        slots = h["slot_mapping"][:num_tokens]
        np.multiply(table[lay.row_req, pos // bs], bs, out=slots)
        slots += pos % bs
        ids = h["input_ids"][:num_tokens]
        ids.fill(0)
        last = [r.last_token for r in reqs]
        ids[lay.qsl[:b]] = last
        for i in prefills:
            ids[lay.qsl[i] : lay.qsl[i + 1]] = reqs[i].prompt_token_ids
        h["query_start_loc"][: nb + 1] = lay.qsl
        seq = h["seq_lens"][:nb]
        np.add(p0, lay.qlens, out=seq)
        h["logits_indices"][: lay.num_logits] = lay.logits_indices
        h["draft_row_indices"][: lay.num_draft_rows] = lay.draft_row_indices
        h["cu_num_draft_tokens"][:nb] = lay.cu_num_draft_tokens
        real_drafts = lay.real_drafts
        if real_drafts:
            src_row = np.array([r.draft_row or 0 for r in reqs], dtype=np.int64)
            np.add(src_row[lay.draft_req] * s, lay.draft_j, out=h["draft_src"][:real_drafts])
        if nb > b:  # padding requests: inert (no KV writes, seq_len 0, masked out)
            slots[lay.real_rows :] = -1
            seq[b:] = 0
            for name, pad in (("temperature", 0.0), ("top_k", 0), ("top_p", 1.0), ("seeds", 0),
                              ("offsets", 0), ("backup_next_token_ids", 0),
                              ("request_mask", False)):  # fmt: skip
                h[name][b:nb] = pad
        h["drafter_seq_lens"][:nb] = seq  # masked after verification
        params = [r.params for r in reqs]
        any_top_k = any(p.top_k > 0 for p in params)
        any_top_p = any(p.top_p < 1.0 for p in params)
        for name, vals in (
            ("temperature", [p.temperature for p in params]),
            ("top_k", [p.top_k for p in params]),
            ("top_p", [p.top_p for p in params]),
            ("seeds", [r.seed for r in reqs]),
            ("offsets", [r.rng_offset for r in reqs]),
            ("backup_next_token_ids", last),
        ):
            h[name][:b] = vals
        h["request_mask"][:b] = True
        staging.upload()

        graph = b_pad is not None
        tensors = staging.step_view(
            num_tokens, nb, width, lay.num_logits, lay.num_draft_rows, max(qlens),
            top_k=graph or any_top_k, top_p=graph or any_top_p, request_mask=graph,
        )  # fmt: skip
        if real_drafts:
            src_idx = staging.prefix("draft_src", real_drafts)
            src = self._last_drafts.view(-1).index_select(0, src_idx)
            rows = tensors.draft_row_indices
            if real_drafts != lay.num_draft_rows:
                rows = staging.prefix("draft_row_indices", real_drafts)
            tensors.input_ids.index_copy_(0, rows, src)
        return _Batch(reqs, num_drafts, first_pos, qlens, tensors, staging, b_pad)

    def _target_and_verify(self, batch: _Batch):
        if batch.b_pad is not None:
            return self.graphs.target_and_verify(batch)
        return self.target_and_verify_eager(batch.tensors, self.num_spec_tokens)

    def target_and_verify_eager(self, t: StepTensors, max_num_drafts: int):
        """Target forward over ``t`` and verification; returns ``(output_token_ids [B, K+1],
        num_accepted [B], aux_hidden [T, 3H])`` on the device. Graph-capturable."""
        meta = AttentionMetadata(
            t.positions, t.slot_mapping, t.query_start_loc, t.seq_lens, t.block_table,
            t.max_query_len,
        )  # fmt: skip
        logits, aux = self.target.forward(t.input_ids, meta, self.target_kv, t.logits_indices)
        drafts = t.input_ids.index_select(0, t.draft_row_indices)
        out = ops.verify_chain(
            logits,
            drafts,
            t.cu_num_draft_tokens,
            t.temperature,
            t.seeds,
            t.offsets,
            top_k=t.top_k,
            top_p=t.top_p,
            request_mask=t.request_mask,
            max_num_draft_tokens=max_num_drafts,
        )
        return out.output_token_ids, out.num_accepted, aux

    def _apply_outputs(self, batch: _Batch, out: torch.Tensor, acc: torch.Tensor) -> list[Request]:
        finished = []
        batch.accepted = [int(a) for a in acc.tolist()]
        for i, r in enumerate(batch.reqs):
            k = batch.num_drafts[i]
            a = batch.accepted[i]
            assert 0 <= a <= k, (r.request_id, a, k)
            r.rng_offset += 1
            r.prefilled = True
            emitted = 0
            for tok in out[i, : a + 1].tolist():
                r.output_token_ids.append(tok)
                emitted += 1
                if tok in r.stop_ids:
                    r.finish_reason = "stop"
                elif (
                    len(r.output_token_ids) >= r.params.max_new_tokens
                    or r.num_tokens >= self.max_model_len
                ):
                    r.finish_reason = "length"
                if r.finish_reason is not None:
                    finished.append(r)
                    break
            # Statistics count emitted tokens only (EDGE_CASES X9): a stop inside the accepted
            # block drops the accepted drafts after it (and the bonus token).
            r.stats.record_step(k, min(a, emitted))
        return finished

    # ------------------------------------------------------------------------------------------
    # Drafting
    # ------------------------------------------------------------------------------------------

    def _draft(self, batch: _Batch, out_tokens: torch.Tensor, aux: torch.Tensor, drafting) -> None:
        """Propose drafts for the requests with ``drafting[i]``; the others become padding
        requests of the drafter batch (inert rows, no KV writes, block table never read)."""
        s = self.num_spec_tokens
        for i, r in enumerate(batch.reqs):
            if drafting[i]:
                # The drafter batch of request i: nv accepted rows, the NTP row, S-1 mask rows
                # (or, for eagle3, S-1 serial positions) from position first_pos (SPEC §3.4).
                nv = batch.qlens[i] - 1 - (batch.num_drafts[i] - batch.accepted[i])
                last = min(batch.first_pos[i] + nv + s - 1, self.drafter_max_len - 1)
                self._ensure_positions(r, last + 1)
        # The drafter segment of the staging (drafter_seq_lens: 0 for requests not drafted; the
        # block table with the blocks just allocated), rewritten in place and uploaded once.
        t, staging, b = batch.tensors, batch.staging, len(batch.reqs)
        h = staging.host()
        nb, width = t.block_table.shape
        seq = h["drafter_seq_lens"]
        seq[:b] = [p + q if d else 0 for p, q, d in zip(batch.first_pos, batch.qlens, drafting,
                                                       strict=True)]  # fmt: skip
        seq[b:nb] = 0
        self._fill_block_table(h["block_table"][: nb * width].reshape(nb, width), batch.reqs)
        staging.upload("drafter")
        if batch.b_pad is not None:
            drafts = self.graphs.draft(batch, out_tokens, aux)
        else:
            drafts = self.draft_eager(t, out_tokens, aux)
        self._last_drafts = drafts
        for i, r in enumerate(batch.reqs):
            r.draft_row = i if drafting[i] else None

    _MAX_DRAFT_WORKSPACES = 16

    def _draft_workspace(
        self, b: int, t_in: int, slots: int, hidden: torch.Tensor
    ) -> ops.DraftInputsWorkspace:
        """Output buffers of the draft step for this shape, reused across steps; fresh (owned by
        the graph's pool) while a CUDA graph is being captured."""
        rows = ops.num_draft_rows(t_in, b, slots)
        key = (b, rows, slots, hidden.shape[1], hidden.dtype)
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        ws = None if capturing else self._draft_workspaces.get(key)
        if ws is None:
            ws = ops.DraftInputsWorkspace(
                b,
                rows,
                num_padding_slots_per_request=slots,
                mask_token_id=self.mask_token_id,
                block_size=self.block_size,
                max_model_len=self.drafter_max_len,
                vocab_size=self.vocab_size,
                device=self.device,
                hidden_size=hidden.shape[1],
                hidden_dtype=hidden.dtype,
            )
            if not capturing:
                self._draft_workspaces[key] = ws
                if len(self._draft_workspaces) > self._MAX_DRAFT_WORKSPACES:
                    self._draft_workspaces.popitem(last=False)
        else:
            self._draft_workspaces.move_to_end(key)
        return ws

    def draft_eager(
        self, t: StepTensors, out_tokens: torch.Tensor, aux: torch.Tensor
    ) -> torch.Tensor:
        """Drafter phase over ``t`` (after verification); returns drafts ``[B, K]`` int32 target
        ids. Graph-capturable."""
        d = self.drafter
        s = self.num_spec_tokens
        parallel = self.method == "peagle"
        b = t.seq_lens.shape[0]
        hidden = d.project_target_hidden(aux)
        ws = self._draft_workspace(b, t.input_ids.shape[0], s if parallel else 1, hidden)
        di = ws(
            t.input_ids,
            t.positions,
            t.query_start_loc,
            t.drafter_seq_lens,
            out_tokens,
            self._no_discard[:b],
            t.backup_next_token_ids,
            t.cu_num_draft_tokens,
            t.block_table,
            hidden,
            self.mask_vector,
        )
        meta = AttentionMetadata(
            di.positions, di.slot_mapping, di.query_start_loc, di.seq_lens, t.block_table,
            t.max_query_len + (s - 1 if parallel else 0),
        )  # fmt: skip
        normed, prenorm = d(di.input_ids, di.hidden_states, meta, self.drafter_kv)
        rows = di.token_indices_to_sample.long()
        if parallel:
            return d.greedy_draft(normed.index_select(0, rows)).view(b, s)
        # EAGLE-3: K-1 more passes, one row per request, each feeding back the pre-norm output.
        tok = d.greedy_draft(normed.index_select(0, rows))
        h = prenorm.index_select(0, rows)
        pos = di.positions.index_select(0, rows)
        real = t.drafter_seq_lens > 0
        qsl = self._arange_i32[: b + 1]
        width = t.block_table.shape[1]
        drafts = [tok]
        for _ in range(1, s):
            pos = pos + 1
            col = torch.clamp(pos // self.block_size, max=width - 1)
            block = t.block_table.gather(1, col.view(-1, 1)).view(-1).long()
            writes = real & (pos < self.drafter_max_len)
            slot = torch.where(writes, block * self.block_size + pos % self.block_size, -1)
            seq = torch.where(real, pos + 1, 0).to(torch.int32)
            meta = AttentionMetadata(pos, slot, qsl, seq, t.block_table, 1)
            normed, h = d(tok, h, meta, self.drafter_kv)
            tok = d.greedy_draft(normed)
            drafts.append(tok)
        return torch.stack(drafts, dim=1)
