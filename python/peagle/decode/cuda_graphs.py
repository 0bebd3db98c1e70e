"""CUDA graphs for the decode steps of :class:`~peagle.decode.engine.SpecDecoder`.

:class:`DecodeGraphs` is given the two phases as callables and the static buffers (the graph-sized
:class:`~peagle.decode.staging.StepStaging`); it knows nothing of the engine.

A step whose requests are all decoding with exactly K drafts (the steady state; prefills and
budget-capped steps run eagerly) has a uniform layout: request i owns target rows
``[i*(K+1), (i+1)*(K+1))``. The batch is padded to the next capture size ``B_pad`` (powers of two
up to ``max_num_seqs``) with *padding requests* (seq_len 0, slot -1, ``request_mask`` False): they
write no KV, never read the block table, emit nothing in verification and are inert in the drafter
batch (SPEC §3.8, EDGE_CASES C1/D1/D2/D5), so the token count is always a multiple of ``1 + K``.

Two graphs per ``B_pad``, sharing one memory pool and one set of static input buffers. The static
input buffers ARE that staging's device buffer: the input builder writes a graph step's inputs,
padding requests included, straight into it with its one upload per phase, so a replay needs no
per-field copy:

* **A**: target forward + ``verify_chain`` -> ``output_token_ids``, ``num_accepted``, aux hidden.
* **B**: ``fc`` + ``prepare_draft_inputs`` + drafter pass(es) + argmax -> drafts ``[B_pad, K]``.

The host syncs once between them (it needs the emitted tokens for stop handling and block
allocation), exactly like the eager loop. Graphs are captured lazily on first use.

Set ``PEAGLE_DEBUG_CHECKS=0`` while capturing (the debug checks copy to the host).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable

import torch

from peagle.decode.inputs import StepTensors
from peagle.models.paged import NULL_BLOCK_ID


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


@contextlib.contextmanager
def _no_cyclic_gc():
    """Python's cyclic GC off while capturing: a collection inside a capture that frees a dead
    engine's CUDA graphs (engines sit in reference cycles) calls cudaGraphExecDestroy mid-capture,
    which invalidates the capture (cudaErrorStreamCaptureInvalidated)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Replayable:
    """``fn`` captured in a CUDA graph (``capture=True``) or re-run eagerly on ``replay`` (the
    same static-buffer layout without graphs: how the CPU tests exercise the padded path)."""

    def __init__(self, fn, capture: bool, pool) -> None:
        self.fn = fn
        self.graph = None
        self.outputs = None
        if capture:
            self.graph = torch.cuda.CUDAGraph()
            with _no_cyclic_gc(), torch.cuda.graph(self.graph, pool=pool):
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
    """Static buffers + lazily captured graphs for uniform decode steps.

    Args:
        staging: the static input buffers (at least ``max_num_seqs * (K + 1)`` rows).
        num_spec_tokens: K of the uniform layout.
        max_num_seqs: the largest capture size.
        target_fn: ``(t, K) -> (output_token_ids, num_accepted, aux_hidden)``, phase A.
        draft_fn: ``(t, output_token_ids, aux_hidden) -> drafts [B, K]``, phase B (None: no
            drafter).
        capture: False runs the same padded layout eagerly (``cuda_graphs="emulate"``).
    """

    def __init__(
        self, staging, num_spec_tokens: int, max_num_seqs: int, target_fn: Callable,
        draft_fn: Callable | None, capture: bool = True,
    ) -> None:  # fmt: skip
        self.capture = capture
        self.k = num_spec_tokens
        self.rows = self.k + 1
        self.sizes = capture_sizes(max_num_seqs)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: dict[int, _Graphs] = {}
        self.staging = staging
        self.target_fn = target_fn
        self.draft_fn = draft_fn
        if self.staging.rows < self.sizes[-1] * self.rows:
            raise ValueError("the engine's staging buffer is smaller than the graph layout")
        self.static = self._view(self.sizes[-1])

    # -- layout ---------------------------------------------------------------------------------

    def pad_size(self, num_drafts, qlens) -> int | None:
        """``B_pad`` of a step whose requests carry ``num_drafts`` drafts in ``qlens`` rows, or
        None when it must run eagerly (not uniform: a prefill or a budget-capped request)."""
        if len(qlens) > self.sizes[-1]:
            return None
        if any(n != self.k for n in num_drafts) or any(q != self.rows for q in qlens):
            return None
        return self._pad_size(len(qlens))

    def _pad_size(self, b: int) -> int:
        return next(s for s in self.sizes if s >= b)

    def _view(self, b_pad: int) -> StepTensors:
        t = b_pad * self.rows
        return self.staging.step_view(
            t, b_pad, self.staging.table_width, t, b_pad * self.k, self.rows,
            top_k=True, top_p=True, request_mask=True,
        )  # fmt: skip

    # -- capture --------------------------------------------------------------------------------

    def _get(self, b_pad: int) -> _Graphs:
        if b_pad in self.graphs:
            return self.graphs[b_pad]
        view = self._view(b_pad)
        # Capture with every request a padding request (inert, no KV writes) in the uniform
        # layout; a step's upload overwrites all of it (the engine captures before uploading).
        dev = view.input_ids.device
        rows = torch.arange(b_pad * self.rows, device=dev)
        ar = torch.arange(b_pad + 1, device=dev)
        view.input_ids.zero_()
        view.positions.zero_()
        view.slot_mapping.fill_(-1)
        view.query_start_loc.copy_(ar * self.rows)
        view.seq_lens.zero_()
        view.block_table.fill_(NULL_BLOCK_ID)
        view.logits_indices.copy_(rows)
        view.draft_row_indices.copy_(rows[rows % self.rows != 0])
        view.cu_num_draft_tokens.copy_(ar[1:] * self.k)
        view.temperature.zero_()
        view.top_k.zero_()
        view.top_p.fill_(1.0)
        view.seeds.zero_()
        view.offsets.zero_()
        view.request_mask.zero_()
        view.backup_next_token_ids.zero_()
        view.drafter_seq_lens.zero_()
        view.request_keys.zero_()
        g = _Graphs()
        # The phases are looked up at call time (a benchmark may wrap them to time emulated
        # replays); the captured work is the same.
        target_fn = lambda: self.target_fn(view, self.k)
        drafter_fn = lambda: self.draft_fn(view, g.target.outputs[0], g.target.outputs[2])
        if self.capture:
            gc.collect()  # free dead engines' graphs now, not inside a capture (_no_cyclic_gc)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up (lazy init, allocator) outside the graph
                    out, _, aux = target_fn()
                    if self.draft_fn is not None:
                        self.draft_fn(view, out, aux)
            torch.cuda.current_stream().wait_stream(side)
        g.target = _Replayable(target_fn, self.capture, self.pool)
        if self.draft_fn is not None:
            g.drafter = _Replayable(drafter_fn, self.capture, self.pool)
        self.graphs[b_pad] = g
        return g

    def prepare(self, b_pad: int) -> None:
        """Capture the graphs of ``b_pad`` now if not yet done (before a step uploads its inputs:
        capturing resets the static buffers)."""
        self._get(b_pad)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture (or, emulated, build) the graphs of every batch size now, so that no capture
        happens inside a timed region (benchmarks; normally graphs are captured on first use,
        inside ``SpecDecoder.step``'s inference mode, as here)."""
        for b_pad in self.sizes:
            self._get(b_pad)

    # -- replay ---------------------------------------------------------------------------------

    def target_and_verify(self, batch):
        """Replay graph A over the inputs :meth:`InputBuilder.build` uploaded; outputs of
        the real requests (views of the graph's output buffers)."""
        b = len(batch.reqs)
        out_tokens, num_accepted, aux = self._get(batch.b_pad).target.replay()
        return out_tokens[:b], num_accepted[:b], aux[: b * self.rows]

    def draft(self, batch, out_tokens, aux) -> torch.Tensor:
        """Replay graph B (the drafter segment of the staging is already uploaded)."""
        return self._get(batch.b_pad).drafter.replay()[: len(batch.reqs)]
