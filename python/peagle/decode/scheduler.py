"""Which requests run in a step, where their rows start, and which KV blocks hold them.

:class:`Scheduler` owns the request queues and the :class:`~peagle.decode.blocks.BlockAllocator`:

* **admission**: a waiting request starts when a batch slot is free and it can *reserve* the
  blocks of its longest possible sequence (so it never runs out mid-flight);
* **positions**: :meth:`schedule` lays out each running request's target rows (a prefill: its
  prompt; a decode: last token + ``k`` drafts, ``k`` capped only by the position limits, EDGE_CASES
  E2/C6: the commit enforces the budgets);
* **block accounting**: blocks are *allocated* from the reservation right before the forward that
  writes them (allocated == written, EDGE C7); target and drafter caches share block ids;
* **release**: a finished request returns every block it holds or reserved.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import numpy as np

from peagle.decode.blocks import BlockAllocator, blocks_for
from peagle.decode.inputs import ScheduledStep
from peagle.decode.request import Request, SamplingParams
from peagle.models.paged import NULL_BLOCK_ID


class Scheduler:
    """Request queues, admission and KV block accounting of one engine.

    Args:
        num_blocks, block_size: the KV caches' blocks (block 0 is the null block).
        max_num_seqs: requests decoded together; more wait.
        max_model_len: prompt + generated tokens per request.
        drafter_max_len: the drafter's position limit (EDGE C6).
        num_spec_tokens: K, the most drafts per step (0 without a drafter).
        max_blocks_per_seq: block-table columns of the widest request.
        vocab_size: token ids are checked against it.
        eos_token_ids: ids that end a request (unless its ``ignore_eos``).
        max_num_batched_tokens: the most rows a step runs (decode rows + admitted prompts; the
            step's first prompt is admitted regardless); None: no limit.
        position_limit: the target's position limit (``max_position_embeddings``; default
            ``max_model_len``): no draft row past it.
    """

    def __init__(
        self, num_blocks: int, block_size: int, max_num_seqs: int, max_model_len: int,
        drafter_max_len: int, num_spec_tokens: int, max_blocks_per_seq: int, vocab_size: int,
        eos_token_ids: Sequence[int] = (), max_num_batched_tokens: int | None = None,
        position_limit: int | None = None,
    ) -> None:  # fmt: skip
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.drafter_max_len = drafter_max_len
        self.position_limit = max_model_len if position_limit is None else position_limit
        self.num_spec_tokens = num_spec_tokens
        self.max_blocks_per_seq = max_blocks_per_seq
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._next_id = 0

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None) -> int:
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

    # -- a step ---------------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        """Admit what fits, then lay out every running request's rows of this step and allocate
        the blocks they write; None when nothing runs."""
        budget = self.max_num_batched_tokens
        if budget is not None:  # what the running requests' decode rows leave for prompts
            budget -= sum(self._decode_rows(r) for r in self.running)
        self._admit(budget)
        if not self.running:
            return None
        reqs = self.running
        num_drafts: list[int] = []
        first_pos: list[int] = []
        qlens: list[int] = []
        prefills: list[int] = []
        for i, r in enumerate(reqs):
            if not r.prefilled:
                p0, k, n = 0, 0, len(r.prompt_token_ids)
                prefills.append(i)
            else:
                n = self._decode_rows(r)
                k, p0 = n - 1, r.num_tokens - 1
            self.ensure_positions(r, p0 + n)
            num_drafts.append(k)
            first_pos.append(p0)
            qlens.append(n)
        return ScheduledStep(reqs, num_drafts, first_pos, qlens, prefills)

    def _decode_rows(self, req: Request) -> int:
        """A prefilled request's rows this step: its last token + the drafts it verifies."""
        return (self.num_drafts(req) if req.draft_row is not None else 0) + 1

    def num_drafts(self, req: Request) -> int:
        """Drafts the request's next verification may carry: its K, with no draft row past the
        target's or the drafter's position limit (EDGE C6). The budgets (``max_new_tokens``,
        ``max_model_len``) do not cap them (EDGE E2): the commit emits nothing past them, the
        rows fit the request's reservation (:meth:`_max_positions`), and full-K steps stay
        uniform, so they replay a CUDA graph instead of running eagerly. Non-increasing as the
        request grows."""
        if self.num_spec_tokens == 0 or req.num_spec_tokens == 0 or not req.prefilled:
            return 0
        n = req.num_tokens
        k = min(
            req.num_spec_tokens,
            self.position_limit - n,
            self.drafter_max_len - n + 1,
        )
        return max(k, 0)

    def ensure_draft_positions(self, batch, drafting: Sequence[bool]) -> None:
        """Blocks for the drafter rows of the requests with ``drafting[i]``: nv accepted rows, the
        NTP row, S-1 mask rows (or, for eagle3, S-1 serial positions) from position first_pos
        (SPEC §3.4)."""
        s = self.num_spec_tokens
        for i, r in enumerate(batch.reqs):
            if drafting[i]:
                nv = batch.qlens[i] - 1 - (batch.num_drafts[i] - batch.accepted[i])
                last = min(batch.first_pos[i] + nv + s - 1, self.drafter_max_len - 1)
                self.ensure_positions(r, last + 1)

    def finish(self, finished: Sequence[Request]) -> None:
        """Release the finished requests' blocks and drop every finished request."""
        for r in finished:
            self._release(r)
            r.stats.wall_time_s = time.perf_counter() - r.start_time
        self.running = [r for r in self.running if r.finish_reason is None]

    # -- blocks ---------------------------------------------------------------------------------

    def _max_positions(self, req: Request) -> int:
        """Positions the request may ever write: its longest sequence plus the drafter's
        ``K - 1`` provisional mask positions."""
        longest = min(len(req.prompt_token_ids) + req.params.max_new_tokens, self.max_model_len)
        return longest + max(self.num_spec_tokens - 1, 0)

    def _admit(self, budget: int | None = None) -> None:
        """Start waiting requests in order while a slot, their KV blocks and (``budget``: rows
        left in this step) their prompt fit; the step's first prompt needs only the slot and
        blocks."""
        first = True
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = len(req.prompt_token_ids)
            if budget is not None and not first and n > budget:
                return
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
            first = False
            if budget is not None:
                budget -= n

    def ensure_positions(self, req: Request, num_positions: int) -> None:
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

    def table_width(self, reqs: Sequence[Request]) -> int:
        """Block-table columns the batch can touch: each request's reservation plus the K + 1
        positions the drafter's rejected tail may read past it (padded with the null block)."""
        extra = self.num_spec_tokens + 1
        width = max(blocks_for(self._max_positions(r) + extra, self.block_size) for r in reqs)
        return min(width, self.max_blocks_per_seq)

    @staticmethod
    def fill_block_table(table: np.ndarray, reqs: Sequence[Request]) -> None:
        """Rows of ``table`` (host ``[>= len(reqs), W]``) for ``reqs``, null-block padded."""
        table[: len(reqs)] = NULL_BLOCK_ID
        for i, r in enumerate(reqs):
            if r.blocks:
                table[i, : len(r.blocks)] = r.blocks
