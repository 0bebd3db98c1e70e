"""``prepare_draft_inputs``: the P-EAGLE drafter batch from the target verify batch in one op.

The wrapper, :class:`DraftInputs` (its outputs), :class:`DraftInputsWorkspace` (the same op in 16
arguments: ``prepare_draft_inputs_workspace``) and the fake kernels, side by side. Semantics:
SPEC.md §3-4 (normative); the C++ entry is csrc/ops/prepare_draft_inputs.cpp.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from peagle.ops._common import _DEBUG_CHECKS, _debug_check_on_cpu, _ops, register_noop_fakes


class DraftInputs(NamedTuple):
    """Drafter batch built by :func:`prepare_draft_inputs` (row outputs have ``num_out_rows``)."""

    input_ids: torch.Tensor  # [num_out_rows] int32
    positions: torch.Tensor  # [num_out_rows] int64
    is_rejected: torch.Tensor  # [num_out_rows] bool
    is_masked: torch.Tensor  # [num_out_rows] bool
    token_indices_to_sample: torch.Tensor  # [B * S] int32
    slot_mapping: torch.Tensor  # [num_out_rows] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    next_token_ids: torch.Tensor  # [B] int32
    valid_sampled_tokens_count: torch.Tensor  # [B] int32
    hidden_states: torch.Tensor | None  # [num_out_rows, H] or None


def num_draft_rows(
    num_target_tokens: int,
    num_reqs: int,
    num_padding_slots_per_request: int,
    shift_input_ids: bool = True,
) -> int:
    """Rows of the drafter batch: ``T_in + B * (S - shift)`` (EDGE_CASES C4)."""
    return num_target_tokens + num_reqs * (num_padding_slots_per_request - int(shift_input_ids))


def empty_draft_inputs(
    num_reqs: int,
    num_out_rows: int,
    num_padding_slots_per_request: int,
    device: torch.device | str,
    hidden_size: int | None = None,
    hidden_dtype: torch.dtype | None = None,
) -> DraftInputs:
    """Allocate the output buffers of :func:`prepare_draft_inputs` (uninitialised)."""
    kw = {"device": device}
    i32, i64 = torch.int32, torch.int64
    return DraftInputs(
        input_ids=torch.empty(num_out_rows, dtype=i32, **kw),
        positions=torch.empty(num_out_rows, dtype=i64, **kw),
        is_rejected=torch.empty(num_out_rows, dtype=torch.bool, **kw),
        is_masked=torch.empty(num_out_rows, dtype=torch.bool, **kw),
        token_indices_to_sample=torch.empty(
            num_reqs * num_padding_slots_per_request, dtype=i32, **kw
        ),
        slot_mapping=torch.empty(num_out_rows, dtype=i64, **kw),
        query_start_loc=torch.empty(num_reqs + 1, dtype=i32, **kw),
        seq_lens=torch.empty(num_reqs, dtype=i32, **kw),
        next_token_ids=torch.empty(num_reqs, dtype=i32, **kw),
        valid_sampled_tokens_count=torch.empty(num_reqs, dtype=i32, **kw),
        hidden_states=None
        if hidden_size is None
        else torch.empty(num_out_rows, hidden_size, dtype=hidden_dtype, **kw),
    )


def prepare_draft_inputs(
    target_token_ids: torch.Tensor,
    target_positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sampled_token_ids: torch.Tensor,
    discard_request_mask: torch.Tensor,
    backup_next_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_padding_slots_per_request: int,
    mask_token_id: int,
    block_size: int,
    max_model_len: int,
    vocab_size: int,
    target_hidden_states: torch.Tensor | None = None,
    mask_hidden: torch.Tensor | None = None,
    padding_token_id: int = 0,
    shift_input_ids: bool = True,
    num_out_rows: int | None = None,
    out: DraftInputs | None = None,
) -> DraftInputs:
    """Build the P-EAGLE drafter batch from the target verify batch in one op (SPEC.md §3-4).

    Fuses vLLM's Stages A-E (next token and valid count, rejected count, copy-and-expand, slot
    mapping, metadata extension) with the hidden-state scatter and the mask broadcast. Request
    ``r`` owns target rows ``[qsl[r], qsl[r+1])`` and drafter rows starting at ``qsl[r] + r*N``
    (``N = S - shift``), laid out as ``[copied ids][NTP][S-1 mask rows][rejected tail]``.

    Parameters:
        target_token_ids: ``[T_in]`` int32, the verify batch's ids (rejected drafts included).
        target_positions: ``[T_in]`` int64 positions.
        query_start_loc: ``[B+1]`` int32 target layout.
        seq_lens: ``[B]`` int32 target KV lengths (including the verify rows); 0 marks a
            CUDA-graph padding request, whose rows are inert and whose block-table row is never
            read.
        sampled_token_ids: ``[B, K+1]`` int32 previous verification output (-1 placeholders);
            a token is valid iff ``0 <= id < vocab_size``.
        discard_request_mask: ``[B]`` bool, requests whose sample is discarded (partial prefill).
        backup_next_token_ids: ``[B]`` int32 next token for discarded / all-invalid rows.
        cu_num_draft_tokens: ``[B]`` int32 inclusive cumsum of the drafts verified per request.
        block_table: ``[B, max_blocks]`` int32 drafter KV block table. Only the columns of rows
            that write KV are read (not rejected, position ``< max_model_len``, real request);
            the rest may hold anything (e.g. -1). A negative id in a needed column (SPEC §3.5):
            the CPU op raises; the CUDA kernel (no host sync) gives those rows slot
            ``PADDING_SLOT_ID``, so they write no KV, and leaves every other output unchanged.
        num_padding_slots_per_request: ``S`` (P-EAGLE and PARD: K; serial draft model: 1).
        mask_token_id: the mask token (``ptd_token_id`` / ``pard_token``) for the S-1 MTP slots.
        block_size: KV-cache block size (tokens per block) of the drafter's cache.
        max_model_len: rows at positions ``>= max_model_len`` get ``PADDING_SLOT_ID``.
        vocab_size: target vocabulary size ``V``.
        target_hidden_states: ``[T_in, H]`` target features already projected by ``fc``
            (bf16/fp16/fp32); with ``mask_hidden`` and shift only.
        mask_hidden: ``[H]`` the projected shared vector ``fc(mask_hidden)``, same dtype.
        padding_token_id: id written into rejected rows (0).
        shift_input_ids: EAGLE shift (True for EAGLE / P-EAGLE, False for PARD / draft models).
        num_out_rows: row capacity (CUDA-graph padding); default ``T_in + B*N``. Rows past the
            live count are inert: id 0, position 0, slot -1, flags False.
        out: preallocated buffers (see :func:`empty_draft_inputs`), written in place.

    Returns:
        :class:`DraftInputs`. Hidden rows of rejected rows are unspecified (SPEC §4).

    Raises:
        RuntimeError: on a wrong shape, dtype or device (naming the argument), and from the CPU
            kernel on inconsistent values (non-monotone ``query_start_loc``, more rejected rows
            than the request has, block table too narrow for a position or a negative block id
            in a needed column, invalid backup token). The CUDA kernel clamps instead (slot -1
            for a missing block; ``PEAGLE_DEBUG_CHECKS=1`` runs the CPU checks first).

    Example:
        The exact tensors of SPEC.md §3.7's worked examples (``tests/test_prepare_draft_inputs.py``
        checks them); random batches: :func:`peagle.testing.make_batch`.
    """
    b = query_start_loc.shape[0] - 1
    if out is None:
        rows = num_out_rows
        if rows is None:
            rows = num_draft_rows(
                target_token_ids.shape[0], b, num_padding_slots_per_request, shift_input_ids
            )
        out = empty_draft_inputs(
            b,
            rows,
            num_padding_slots_per_request,
            target_token_ids.device,
            None if target_hidden_states is None else target_hidden_states.shape[1],
            None if target_hidden_states is None else target_hidden_states.dtype,
        )
    args = [
        target_token_ids, target_positions, query_start_loc, seq_lens, sampled_token_ids,
        discard_request_mask, backup_next_token_ids, cu_num_draft_tokens, block_table,
        target_hidden_states, mask_hidden, num_padding_slots_per_request, mask_token_id,
        padding_token_id, shift_input_ids, block_size, max_model_len, vocab_size,
        out.input_ids, out.positions, out.is_rejected, out.is_masked,
        out.token_indices_to_sample, out.slot_mapping, out.query_start_loc, out.seq_lens,
        out.next_token_ids, out.valid_sampled_tokens_count, out.hidden_states,
    ]  # fmt: skip
    _debug_check_on_cpu(_ops.prepare_draft_inputs.default, args)
    _ops.prepare_draft_inputs.default(*args)
    return out


class DraftInputsWorkspace:
    """Persistent outputs of :func:`prepare_draft_inputs` and the short call into them.

    The same op (same kernel, same outputs) with 16 arguments per call instead of 29: the host
    scalars live in one CPU int64 ``config`` tensor built here, and the ten non-hidden outputs
    are views into three 1-D device buffers, one per dtype (``workspace_i64``, ``workspace_i32``,
    ``workspace_bool``; element offsets from
    ``torch.ops.peagle.prepare_draft_inputs_workspace_layout``, 16-byte aligned). The
    dispatcher's per-call cost grows with the argument count, so this is the form for a decode
    loop; FlashInfer's plan/run wrappers follow the same idea (shapes fixed once, data per call).
    One buffer per dtype keeps it traceable by ``torch.compile`` (AOTAutograd cannot
    functionalize in-place writes seen through views of another dtype).

    Parameters:
        num_reqs: ``B`` (CUDA-graph padding requests included).
        num_out_rows: row capacity ``>= T_in + B*N`` (:func:`num_draft_rows`).
        num_padding_slots_per_request, mask_token_id, block_size, max_model_len, vocab_size,
        padding_token_id, shift_input_ids: as in :func:`prepare_draft_inputs`.
        device: where the outputs live.
        hidden_size, hidden_dtype: allocate ``hidden_states [num_out_rows, H]`` (P-EAGLE);
            None for the token-only form (e.g. ``shift_input_ids=False``).

    Attributes:
        out: :class:`DraftInputs` of views into the buffers (rewritten by every call).

    Raises:
        RuntimeError: from the op when a call does not fit the layout (another ``B``, more rows
            than ``num_out_rows``) and on every error of :func:`prepare_draft_inputs`.
    """

    def __init__(
        self,
        num_reqs: int,
        num_out_rows: int,
        *,
        num_padding_slots_per_request: int,
        mask_token_id: int,
        block_size: int,
        max_model_len: int,
        vocab_size: int,
        device: torch.device | str,
        padding_token_id: int = 0,
        shift_input_ids: bool = True,
        hidden_size: int | None = None,
        hidden_dtype: torch.dtype | None = None,
    ) -> None:
        s, b, rows = num_padding_slots_per_request, num_reqs, num_out_rows
        lay = _ops.prepare_draft_inputs_workspace_layout(b, s, rows)
        self.config = torch.tensor(
            [s, mask_token_id, padding_token_id, int(shift_input_ids), block_size, max_model_len,
             vocab_size, rows, b],
            dtype=torch.int64,
        )  # fmt: skip
        w64 = torch.empty(lay[2], dtype=torch.int64, device=device)
        w32 = torch.empty(lay[9], dtype=torch.int32, device=device)
        wb = torch.empty(lay[12], dtype=torch.bool, device=device)
        self.workspace_i64, self.workspace_i32, self.workspace_bool = w64, w32, wb
        self.out = DraftInputs(
            input_ids=w32[lay[3] : lay[3] + rows],
            positions=w64[lay[0] : lay[0] + rows],
            is_rejected=wb[lay[10] : lay[10] + rows],
            is_masked=wb[lay[11] : lay[11] + rows],
            token_indices_to_sample=w32[lay[4] : lay[4] + b * s],
            slot_mapping=w64[lay[1] : lay[1] + rows],
            query_start_loc=w32[lay[5] : lay[5] + b + 1],
            seq_lens=w32[lay[6] : lay[6] + b],
            next_token_ids=w32[lay[7] : lay[7] + b],
            valid_sampled_tokens_count=w32[lay[8] : lay[8] + b],
            hidden_states=None
            if hidden_size is None
            else torch.empty(rows, hidden_size, dtype=hidden_dtype, device=device),
        )
        self._op = _ops.prepare_draft_inputs_workspace.default

    def __call__(
        self,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        sampled_token_ids: torch.Tensor,
        discard_request_mask: torch.Tensor,
        backup_next_token_ids: torch.Tensor,
        cu_num_draft_tokens: torch.Tensor,
        block_table: torch.Tensor,
        target_hidden_states: torch.Tensor | None = None,
        mask_hidden: torch.Tensor | None = None,
    ) -> DraftInputs:
        """Run the draft step into :attr:`out` (inputs as in :func:`prepare_draft_inputs`)."""
        args = (
            target_token_ids, target_positions, query_start_loc, seq_lens, sampled_token_ids,
            discard_request_mask, backup_next_token_ids, cu_num_draft_tokens, block_table,
            target_hidden_states, mask_hidden, self.config, self.workspace_i64,
            self.workspace_i32, self.workspace_bool, self.out.hidden_states,
        )  # fmt: skip
        if _DEBUG_CHECKS:
            _debug_check_on_cpu(self._op, list(args))
        self._op(*args)
        return self.out


register_noop_fakes("prepare_draft_inputs", "prepare_draft_inputs_workspace")
