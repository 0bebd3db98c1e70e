"""Proposers: drafts ``[B, K]`` for the next step from this step's verification outputs.

Both take the same ``propose(t, out_tokens, aux) -> drafts`` and run, after verification:
``fc`` over the target's auxiliary hidden states, ``peagle.prepare_draft_inputs`` (through a
reused :class:`~peagle.ops.DraftInputsWorkspace`) and a drafter pass over the batch it builds.

* :class:`PEagleProposer`: ONE pass over ``[accepted | NTP | K-1 mask | rejected]`` rows per
  request (rejected rows get slot -1 so they never write KV, EDGE C3); K drafts per request from
  the NTP and mask rows.
* :class:`Eagle3Proposer`: the same op with one slot (no mask rows) gives the first draft, then
  K-1 sequential one-row passes feed back the drafter's pre-norm output.

Requests not drafted this step are padding requests of the drafter batch (``drafter_seq_lens``
0: inert rows, no KV writes, block table never read). Graph-capturable.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from peagle import ops
from peagle.decode.inputs import StepTensors
from peagle.models.drafter import Eagle3Drafter
from peagle.models.paged import AttentionMetadata


class _Proposer:
    """The shared first pass: ``fc`` + the draft-inputs op + one drafter forward."""

    parallel = False
    _MAX_DRAFT_WORKSPACES = 16

    def __init__(
        self, drafter: Eagle3Drafter, kv_cache, num_spec_tokens: int, max_num_seqs: int,
        block_size: int, max_model_len: int, vocab_size: int,
    ) -> None:  # fmt: skip
        self.drafter = drafter
        self.kv_cache = kv_cache
        self.num_spec_tokens = num_spec_tokens
        self.block_size = block_size
        self.drafter_max_len = max_model_len
        self.vocab_size = vocab_size
        self.device = drafter.device
        if self.parallel:
            self.mask_token_id = int(drafter.config.mask_token_id)
            self.mask_vector = drafter.mask_vector().to(drafter.dtype)
        else:
            self.mask_token_id = 0
            self.mask_vector = torch.zeros(
                drafter.config.hidden_size, dtype=drafter.dtype, device=self.device
            )
        self._no_discard = torch.zeros(max_num_seqs, dtype=torch.bool, device=self.device)
        self._arange_i32 = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=self.device)
        # Draft-step output buffers by (B, rows, hidden dtype): the short op call, no per-step
        # allocation (a few shapes recur in decode; bounded for ragged prefill mixes).
        self._draft_workspaces: OrderedDict[tuple, ops.DraftInputsWorkspace] = OrderedDict()

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

    def _first_pass(self, t: StepTensors, out_tokens: torch.Tensor, aux: torch.Tensor):
        """``(normed rows to sample, prenorm rows to sample, draft inputs)`` of the first pass."""
        d = self.drafter
        s = self.num_spec_tokens
        b = t.seq_lens.shape[0]
        hidden = d.project_target_hidden(aux)
        ws = self._draft_workspace(b, t.input_ids.shape[0], s if self.parallel else 1, hidden)
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
            t.max_query_len + (s - 1 if self.parallel else 0),
        )  # fmt: skip
        normed, prenorm = d(di.input_ids, di.hidden_states, meta, self.kv_cache)
        return normed, prenorm, di


class PEagleProposer(_Proposer):
    """P-EAGLE: all K drafts from one drafter pass."""

    parallel = True

    def propose(self, t: StepTensors, out_tokens: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """Drafts ``[B, K]`` int32 target ids for the requests of ``t`` (after verification)."""
        normed, _, di = self._first_pass(t, out_tokens, aux)
        rows = di.token_indices_to_sample.long()
        b = t.seq_lens.shape[0]
        return self.drafter.greedy_draft(normed.index_select(0, rows)).view(b, self.num_spec_tokens)


class Eagle3Proposer(_Proposer):
    """EAGLE-3: the first draft from the first pass, then K-1 one-row passes."""

    def propose(self, t: StepTensors, out_tokens: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """Drafts ``[B, K]`` int32 target ids for the requests of ``t`` (after verification)."""
        d = self.drafter
        normed, prenorm, di = self._first_pass(t, out_tokens, aux)
        rows = di.token_indices_to_sample.long()
        b = t.seq_lens.shape[0]
        # K-1 more passes, one row per request, each feeding back the pre-norm output.
        tok = d.greedy_draft(normed.index_select(0, rows))
        h = prenorm.index_select(0, rows)
        pos = di.positions.index_select(0, rows)
        real = t.drafter_seq_lens > 0
        qsl = self._arange_i32[: b + 1]
        width = t.block_table.shape[1]
        drafts = [tok]
        for _ in range(1, self.num_spec_tokens):
            pos = pos + 1
            col = torch.clamp(pos // self.block_size, max=width - 1)
            block = t.block_table.gather(1, col.view(-1, 1)).view(-1).long()
            writes = real & (pos < self.drafter_max_len)
            slot = torch.where(writes, block * self.block_size + pos % self.block_size, -1)
            seq = torch.where(real, pos + 1, 0).to(torch.int32)
            meta = AttentionMetadata(pos, slot, qsl, seq, t.block_table, 1)
            normed, h = d(tok, h, meta, self.kv_cache)
            tok = d.greedy_draft(normed)
            drafts.append(tok)
        return torch.stack(drafts, dim=1)


PROPOSERS = {"peagle": PEagleProposer, "eagle3": Eagle3Proposer}
