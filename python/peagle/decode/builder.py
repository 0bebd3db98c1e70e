"""Step inputs: a scheduled step -> the host staging buffer (numpy) -> ONE upload -> device views.

:class:`InputBuilder` writes every small input of a step (positions, slots, ids, the verification
layout, sampling parameters, the block table) into the host side of a
:class:`~peagle.decode.staging.StepStaging`, uploads it once and fills the draft rows from the
previous step's drafts on the device. A CUDA-graph step (``b_pad`` given) is padded to ``b_pad``
requests with inert *padding requests* (K drafts each like the real ones; no KV writes, seq_len 0,
masked out) in the graph's static layout. After verification, :meth:`InputBuilder.upload_drafter`
rewrites and re-uploads only the drafter segment.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from peagle.decode.inputs import Batch, ScheduledStep, row_layout
from peagle.decode.scheduler import Scheduler
from peagle.decode.staging import StepStaging


class InputBuilder:
    """Builds each step's :class:`~peagle.decode.inputs.StepTensors` through the staging buffers.

    Every small per-step input goes through one staging buffer (one upload per phase), sized for
    the CUDA graphs' layout (``staging``, their static buffers); steps with more rows (prefills)
    use a second one grown on demand."""

    def __init__(
        self, scheduler: Scheduler, num_spec_tokens: int, device: torch.device,
        request_keys: bool = False,
    ) -> None:  # fmt: skip
        """``request_keys``: also write each request's id into ``request_keys`` (the draw keys of
        synthetic acceptance, :mod:`~peagle.decode.synthetic`)."""
        self.scheduler = scheduler
        self.request_keys = request_keys
        self.num_spec_tokens = num_spec_tokens
        self.block_size = scheduler.block_size
        self.max_num_seqs = scheduler.max_num_seqs
        self.max_blocks_per_seq = scheduler.max_blocks_per_seq
        self.device = device
        self.staging = StepStaging(
            max(self.max_num_seqs * (num_spec_tokens + 1), 256), self.max_num_seqs,
            self.max_blocks_per_seq, device,
        )  # fmt: skip
        self._staging_big: StepStaging | None = None

    def _staging_for(self, num_tokens: int) -> StepStaging:
        if num_tokens <= self.staging.rows:
            return self.staging
        big = self._staging_big
        if big is None or big.rows < num_tokens:
            rows = 1 << (num_tokens - 1).bit_length()
            big = StepStaging(rows, self.max_num_seqs, self.max_blocks_per_seq, self.device)
            self._staging_big = big
        return big

    def build(
        self, step: ScheduledStep, b_pad: int | None, last_drafts: torch.Tensor | None
    ) -> Batch:
        """Lay out the step's target rows (a prefill: its prompt; a decode: last token + k draft
        rows) in ``b_pad`` requests (None: eager, no padding), write every input into the host
        staging buffer, upload it once and fill the draft rows from ``last_drafts`` (the previous
        step's ``[B, K]`` drafts) on the device."""
        s = self.num_spec_tokens
        reqs, num_drafts, first_pos = step.reqs, step.num_drafts, step.first_pos
        qlens, prefills = step.qlens, step.prefills
        b = len(reqs)
        # Padding requests of a graph step: K drafts each, like the real ones, but inert.
        nb = b if b_pad is None else b_pad
        lay = row_layout(tuple(qlens) + (s + 1,) * (nb - b), tuple(num_drafts) + (s,) * (nb - b), b)
        num_tokens = lay.num_tokens
        staging = self._staging_for(num_tokens)
        width = staging.table_width if b_pad is not None else self.scheduler.table_width(reqs)
        h = staging.host()  # waits until the previous upload has been read (CUDA)

        table = h["block_table"][: nb * width].reshape(nb, width)
        self.scheduler.fill_block_table(table, reqs)
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
        if self.request_keys:
            keys = h["request_keys"]
            keys[:b] = [r.request_id for r in reqs]
            keys[b:nb] = 0
        staging.upload()

        graph = b_pad is not None
        tensors = staging.step_view(
            num_tokens, nb, width, lay.num_logits, lay.num_draft_rows, max(qlens),
            top_k=graph or any_top_k, top_p=graph or any_top_p, request_mask=graph,
        )  # fmt: skip
        if real_drafts:
            src_idx = staging.prefix("draft_src", real_drafts)
            src = last_drafts.view(-1).index_select(0, src_idx)
            rows = tensors.draft_row_indices
            if real_drafts != lay.num_draft_rows:
                rows = staging.prefix("draft_row_indices", real_drafts)
            tensors.input_ids.index_copy_(0, rows, src)
        return Batch(reqs, num_drafts, first_pos, qlens, tensors, staging, b_pad)

    def upload_drafter(self, batch: Batch, drafting: Sequence[bool]) -> None:
        """The drafter segment of the staging (drafter_seq_lens: 0 for requests not drafted; the
        block table with the blocks just allocated), rewritten in place and uploaded once."""
        t, staging, b = batch.tensors, batch.staging, len(batch.reqs)
        h = staging.host()
        nb, width = t.block_table.shape
        seq = h["drafter_seq_lens"]
        seq[:b] = [p + q if d else 0 for p, q, d in zip(batch.first_pos, batch.qlens, drafting,
                                                       strict=True)]  # fmt: skip
        seq[b:nb] = 0
        self.scheduler.fill_block_table(
            h["block_table"][: nb * width].reshape(nb, width), batch.reqs
        )
        staging.upload("drafter")
