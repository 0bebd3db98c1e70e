"""CUDA graphs for the decode steps of :class:`~peagle.decode.engine.SpecDecoder`.

A step whose requests are all decoding with exactly K drafts (the steady state; prefills and
budget-capped steps run eagerly) has a uniform layout: request i owns target rows
``[i*(K+1), (i+1)*(K+1))``. The batch is padded to the next capture size ``B_pad`` (powers of two
up to ``max_num_seqs``) with *padding requests* (seq_len 0, slot -1, ``request_mask`` False): they
write no KV, never read the block table, emit nothing in verification and are inert in the drafter
batch (SPEC §3.8, EDGE_CASES C1/D1/D2/D5), so the token count is always a multiple of ``1 + K``.

Two graphs per ``B_pad``, sharing one memory pool and one set of static input buffers:

* **A**: target forward + ``verify_chain`` -> ``output_token_ids``, ``num_accepted``, aux hidden.
* **B**: ``fc`` + ``prepare_draft_inputs`` + drafter pass(es) + argmax -> drafts ``[B_pad, K]``.

The host syncs once between them (it needs the emitted tokens for stop handling and block
allocation), exactly like the eager loop. Graphs are captured lazily on first use.

Set ``PEAGLE_DEBUG_CHECKS=0`` while capturing (the debug checks copy to the host).
"""

from __future__ import annotations

import torch

from peagle.decode.engine import StepTensors


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


class _Replayable:
    """``fn`` captured in a CUDA graph (``capture=True``) or re-run eagerly on ``replay`` (the
    same static-buffer layout without graphs: how the CPU tests exercise the padded path)."""

    def __init__(self, fn, capture: bool, pool) -> None:
        self.fn = fn
        self.graph = None
        self.outputs = None
        if capture:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.outputs = fn()

    def replay(self):
        if self.graph is None:
            self.outputs = self.fn()
        else:
            self.graph.replay()
        return self.outputs


class _Graphs:
    def __init__(self) -> None:
        self.target: _Replayable | None = None
        self.drafter: _Replayable | None = None


class DecodeGraphs:
    """Static buffers + lazily captured graphs for uniform decode steps of one engine."""

    def __init__(self, engine, capture: bool = True) -> None:
        self.engine = engine
        self.capture = capture
        self.k = engine.num_spec_tokens
        self.rows = self.k + 1
        self.sizes = capture_sizes(engine.max_num_seqs)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: dict[int, _Graphs] = {}
        b, dev = engine.max_num_seqs, engine.device
        t = b * self.rows
        i32, i64 = torch.int32, torch.int64
        z = lambda n, dt: torch.zeros(n, dtype=dt, device=dev)
        rows = torch.arange(t, device=dev)
        self.static = StepTensors(
            input_ids=z(t, i32),
            positions=z(t, i64),
            slot_mapping=torch.full((t,), -1, dtype=i64, device=dev),
            query_start_loc=(torch.arange(b + 1, device=dev) * self.rows).to(i32),
            seq_lens=z(b, i32),
            block_table=torch.zeros(b, engine.max_blocks_per_seq, dtype=i32, device=dev),
            logits_indices=rows.clone(),
            draft_row_indices=rows[rows % self.rows != 0].clone(),
            cu_num_draft_tokens=(torch.arange(1, b + 1, device=dev) * self.k).to(i32),
            temperature=z(b, torch.float32),
            top_k=z(b, i32),
            top_p=torch.ones(b, dtype=torch.float32, device=dev),
            seeds=z(b, i64),
            offsets=z(b, i64),
            request_mask=z(b, torch.bool),
            backup_next_token_ids=z(b, i32),
            drafter_seq_lens=z(b, i32),
            max_query_len=self.rows,
        )

    # -- layout ---------------------------------------------------------------------------------

    def can_run(self, batch) -> bool:
        return (
            len(batch.reqs) <= self.sizes[-1]
            and all(n == self.k for n in batch.num_drafts)
            and all(q == self.rows for q in batch.qlens)
        )

    def _pad_size(self, b: int) -> int:
        return next(s for s in self.sizes if s >= b)

    def _view(self, b_pad: int) -> StepTensors:
        s, t = self.static, b_pad * self.rows
        return StepTensors(
            input_ids=s.input_ids[:t],
            positions=s.positions[:t],
            slot_mapping=s.slot_mapping[:t],
            query_start_loc=s.query_start_loc[: b_pad + 1],
            seq_lens=s.seq_lens[:b_pad],
            block_table=s.block_table[:b_pad],
            logits_indices=s.logits_indices[:t],
            draft_row_indices=s.draft_row_indices[: b_pad * self.k],
            cu_num_draft_tokens=s.cu_num_draft_tokens[:b_pad],
            temperature=s.temperature[:b_pad],
            top_k=s.top_k[:b_pad],
            top_p=s.top_p[:b_pad],
            seeds=s.seeds[:b_pad],
            offsets=s.offsets[:b_pad],
            request_mask=s.request_mask[:b_pad],
            backup_next_token_ids=s.backup_next_token_ids[:b_pad],
            drafter_seq_lens=s.drafter_seq_lens[:b_pad],
            max_query_len=self.rows,
        )

    # -- capture --------------------------------------------------------------------------------

    def _get(self, b_pad: int) -> _Graphs:
        if b_pad in self.graphs:
            return self.graphs[b_pad]
        eng, view = self.engine, self._view(b_pad)
        # Capture with every request a padding request: inert, no KV writes.
        view.seq_lens.zero_()
        view.drafter_seq_lens.zero_()
        view.request_mask.zero_()
        view.slot_mapping.fill_(-1)
        g = _Graphs()
        target_fn = lambda: eng.target_and_verify_eager(view, self.k)
        drafter_fn = lambda: eng.draft_eager(view, g.target.outputs[0], g.target.outputs[2])
        if self.capture:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up (lazy init, allocator) outside the graph
                    out, _, aux = target_fn()
                    if eng.drafter is not None:
                        eng.draft_eager(view, out, aux)
            torch.cuda.current_stream().wait_stream(side)
        g.target = _Replayable(target_fn, self.capture, self.pool)
        if eng.drafter is not None:
            g.drafter = _Replayable(drafter_fn, self.capture, self.pool)
        self.graphs[b_pad] = g
        return g

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture (or, emulated, build) the graphs of every batch size now, so that no capture
        happens inside a timed region (benchmarks; normally graphs are captured on first use,
        inside ``SpecDecoder.step``'s inference mode, as here)."""
        for b_pad in self.sizes:
            self._get(b_pad)

    # -- replay ---------------------------------------------------------------------------------

    @staticmethod
    def _load(t: StepTensors, view: StepTensors, names) -> None:
        for name in names:
            src = getattr(t, name)
            getattr(view, name)[: src.shape[0]].copy_(src, non_blocking=True)

    def target_and_verify(self, batch):
        b = len(batch.reqs)
        b_pad = self._pad_size(b)
        g = self._get(b_pad)
        t, view = batch.tensors, self._view(b_pad)
        names = ("input_ids", "positions", "slot_mapping", "seq_lens", "temperature", "seeds")
        self._load(t, view, (*names, "offsets", "backup_next_token_ids"))
        view.block_table[:b, : t.block_table.shape[1]].copy_(t.block_table, non_blocking=True)
        view.top_k[:b].copy_(t.top_k if t.top_k is not None else torch.zeros_like(view.top_k[:b]))
        view.top_p[:b].copy_(t.top_p if t.top_p is not None else torch.ones_like(view.top_p[:b]))
        view.request_mask[:b] = True
        # Padding requests (rows past the real ones) must stay inert.
        view.request_mask[b:] = False
        view.seq_lens[b:] = 0
        view.slot_mapping[b * self.rows :] = -1
        out_tokens, num_accepted, aux = g.target.replay()
        return out_tokens[:b], num_accepted[:b], aux[: b * self.rows]

    def draft(self, batch, out_tokens, aux) -> torch.Tensor:
        b = len(batch.reqs)
        b_pad = self._pad_size(b)
        g = self._get(b_pad)
        t, view = batch.tensors, self._view(b_pad)
        view.drafter_seq_lens[:b].copy_(t.drafter_seq_lens, non_blocking=True)
        view.drafter_seq_lens[b:] = 0
        view.block_table[:b, : t.block_table.shape[1]].copy_(t.block_table, non_blocking=True)
        return g.drafter.replay()[:b]
