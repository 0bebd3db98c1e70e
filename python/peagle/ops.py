"""Thin wrappers over ``torch.ops.peagle.*`` and their fake (meta) kernels.

Every op writes into caller-provided buffers (so a CUDA graph can replay it with persistent
buffers); the wrappers here allocate those buffers when they are not given. Shape, dtype and
device errors are raised by the C++ op as ``RuntimeError`` naming the argument. Value errors
(out-of-range ids, inconsistent lengths) are raised by the CPU kernels; the CUDA kernels never
read or write out of bounds but cannot raise without a host sync, so set
``PEAGLE_DEBUG_CHECKS=1`` to validate CUDA inputs by running the CPU op on copies first.

Conventions (SPEC.md §0): token ids int32, positions and slot mappings int64, ``query_start_loc``
/ ``seq_lens`` / ``block_table`` / ``cu_num_draft_tokens`` / sample indices int32;
``PADDING_SLOT_ID = -1`` (no KV write), ``PLACEHOLDER_TOKEN_ID = -1`` (no token).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch

PADDING_SLOT_ID = -1
PLACEHOLDER_TOKEN_ID = -1

_ops = torch.ops.peagle

__all__ = [
    "PADDING_SLOT_ID",
    "PLACEHOLDER_TOKEN_ID",
    "DraftInputs",
    "DraftInputsWorkspace",
    "VerifyOutput",
    "empty_draft_inputs",
    "num_draft_rows",
    "paged_attention",
    "prepare_draft_inputs",
    "prepare_next_token_ids",
    "verify_chain",
    "write_kv_cache",
]


_DEBUG_CHECKS = os.environ.get("PEAGLE_DEBUG_CHECKS", "0") not in ("", "0")


def _debug_checks_enabled() -> bool:
    """``PEAGLE_DEBUG_CHECKS`` is read once at import (the wrappers sit on the hot path)."""
    return _DEBUG_CHECKS


def _debug_check_on_cpu(op, args: list) -> None:
    """Run ``op`` on CPU copies of ``args`` so the CPU kernel's value checks see CUDA inputs."""
    if not _debug_checks_enabled():
        return
    if not any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
        return
    op(*[a.detach().cpu().clone() if isinstance(a, torch.Tensor) else a for a in args])


# ---------------------------------------------------------------------------------------------
# prepare_draft_inputs / prepare_next_token_ids
# ---------------------------------------------------------------------------------------------


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

    Args:
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

    Args:
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


def prepare_next_token_ids(
    sampled_token_ids: torch.Tensor,
    discard_request_mask: torch.Tensor,
    backup_next_token_ids: torch.Tensor,
    vocab_size: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage A alone (SPEC §3.2): ``(next_token_ids [B] int32, valid_sampled_tokens_count [B])``.

    For each request: discarded -> ``(backup, 0)``; otherwise the count of valid ids
    (``0 <= id < vocab_size``) in its ``[K+1]`` row and the id at the largest valid column, or
    the backup token when none is valid. Equivalent to vLLM's
    ``eagle_prepare_next_token_padded_kernel`` except that any negative id is invalid.
    """
    b = sampled_token_ids.shape[0]
    if out is None:
        dev = sampled_token_ids.device
        out = (
            torch.empty(b, dtype=torch.int32, device=dev),
            torch.empty(b, dtype=torch.int32, device=dev),
        )
    _ops.prepare_next_token_ids.default(
        sampled_token_ids, discard_request_mask, backup_next_token_ids, vocab_size, out[0], out[1]
    )
    return out


# ---------------------------------------------------------------------------------------------
# write_kv_cache / paged_attention
# ---------------------------------------------------------------------------------------------


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V rows into the paged cache (SPEC §5), in place, before attention.

    Args:
        key, value: ``[T, Hkv, D]`` new rows, bf16/fp16/fp32 (same dtype as the caches); strided
            views allowed (e.g. slices of a fused qkv output) with unit stride in ``D``.
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]``; strided views allowed
            (e.g. the halves of a ``[2, num_blocks, ...]`` cache), unit stride in ``D``; never
            copied, written in place.
        slot_mapping: ``[T]`` int64; row ``t`` goes to block ``s // block_size``, offset
            ``s % block_size``; ``PADDING_SLOT_ID`` (-1) rows write nothing. Rows sharing a slot
            race (which one lands is unspecified).

    Raises:
        RuntimeError: shape/dtype/device mismatch or a non-unit stride in ``D`` (naming the
            argument). CPU: a slot that is neither -1 nor in ``[0, num_blocks * block_size)``
            (nothing is written then). CUDA cannot raise on values without a host sync: such rows
            are skipped, never written out of bounds (``PEAGLE_DEBUG_CHECKS=1`` runs the CPU
            checks first).
    """
    args = [key, value, key_cache, value_cache, slot_mapping]
    _debug_check_on_cpu(_ops.write_kv_cache.default, args)
    _ops.write_kv_cache.default(*args)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    max_query_len: int = -1,
    window_left: int = -1,
    sinks: torch.Tensor | None = None,
    num_splits: int = 0,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of ragged query rows over a paged KV cache (SPEC §5).

    Request ``r`` owns query rows ``[qsl[r], qsl[r+1])``; with ``qlen`` rows and ``kv_len =
    seq_lens[r]`` keys (this step's rows included, already written by :func:`write_kv_cache`),
    row ``i`` sees keys ``max(0, kv_len - qlen + i - window_left) <= k <= kv_len - qlen + i``
    (bottom-right aligned causal mask; no lower bound when ``window_left < 0``). Query head ``h``
    reads KV head ``h // (Hq // Hkv)`` (GQA). Scores ``softmax_scale * q.k``, the softmax and the
    weighted sum of V run in fp32; the output is rounded to the input dtype. All rows and heads of
    a request share one pass over its KV pages. Keys a row may not see never affect it, whatever
    they hold (NaN/inf included); a row that sees a non-finite K/V value is not finite (SPEC §5).

    Args:
        query: ``[T, Hq, D]`` bf16/fp16 (fp32 accepted on CPU only), after RoPE; strided views
            allowed with unit stride in ``D``.
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]``, same dtype; strided views
            allowed (e.g. the halves of a ``[2, num_blocks, ...]`` cache), unit stride in ``D``,
            never copied. ``block_size`` a power of two (CUDA: >= 8).
        block_table: ``[B, max_blocks]`` int32 physical block per logical block. Only columns
            ``< ceil(kv_len / block_size)`` of requests with ``qlen > 0`` and ``kv_len > 0`` are
            read (with a window, only those from the first row's window start); the rest may
            hold anything (e.g. -1).
        query_start_loc: ``[B+1]`` int32 non-decreasing row offsets; ``seq_lens``: ``[B]`` int32.
            A request with ``qlen == 0`` is a padding request: it reads nothing.
        softmax_scale: default ``1/sqrt(D)``.
        max_query_len: upper bound on query rows per request; a launch-size hint for the CUDA
            kernel (-1 = T, which over-provisions CTAs for decode batches: pass the real bound,
            e.g. ``2K``). Results never depend on it beyond fp32 rounding (bitwise with a fixed
            ``num_splits``); a request with more rows is still computed in full.
        window_left: sliding-window size to the left (GPT-OSS); -1 = full attention.
        sinks: optional ``[Hq]`` fp32 per-head sink logits (not scaled): one more term
            ``exp(sinks[h])`` in the softmax denominator that carries no value.
        num_splits: CUDA split-KV count per (request, KV head, query tile); 0 = chosen on the
            device from ``seq_lens`` (capped from host-known sizes; CUDA-graph safe), ``> 0`` =
            that many (clamped to the request's KV tiles of 64 keys, 32 with the ``n32`` variant),
            which makes a request's result independent of the rest of the batch. Any mode is
            bit-reproducible run to run (for a given kernel variant). Ignored on CPU. At most 256;
            on CUDA also ``B * Hkv * num_splits < 2^31 - 64``.
        return_lse: also return ``[T, Hq]`` fp32 log-sum-exp (natural log of the scaled scores,
            sink included).
        out, lse: preallocated outputs (``out`` may be a strided view with unit stride in ``D``;
            ``lse`` needs unit stride in ``Hq``), fully overwritten.

    CUDA kernel (csrc/cuda/paged_attention.cu): the GQA group and the request's query rows are
    packed into one MMA tile per KV head (64 rows for ``Hq/Hkv <= 4``, else 128), so every KV
    page is read once per KV head for all rows; the KV range is split across CTAs on the device
    for small batches / long contexts, with a merge kernel. Both kernels are launched with
    programmatic dependent launch (``PEAGLE_DISABLE_PDL=1``: plain launches). Tensor cores:
    ``wgmma`` on sm_90 for ``Hq/Hkv >= 4``, else ``mma.sync`` (sm_100 always);
    ``PEAGLE_ATTN_IMPL`` (read at every call, so at graph capture) forces ``mma`` or ``wgmma``
    and/or ``n32`` (32-key KV tiles, head_dim 128 with 64-row tiles) for benchmarks and tests;
    variants agree to fp32 accumulation order. No host sync; CUDA-graph safe.

    Returns:
        ``out [T, Hq, D]`` (and ``lse``). Rows that see no key (``kv_len == 0``, ``qlen >
        kv_len`` early rows) give 0 and ``lse = -inf`` (``lse = sinks[h]`` with sinks); masked
        keys are excluded, never given a finite sentinel score, so very negative valid scores
        stay exact (SPEC §5, EDGE_CASES X4), and identical requests give bit-identical rows at
        any batch index (X1). Rows
        outside every request (before ``qsl[0]`` or from ``qsl[B]`` on: a padded tail) give 0 and
        ``lse = -inf`` (so ``B == 0`` with ``T > 0`` writes every row inert); ``T == 0`` returns
        at once.

    Raises:
        RuntimeError: shape/dtype/device mismatch (naming the argument), ``Hq % Hkv != 0``, a
            block size that is not a power of two, a non-unit stride in ``D``; on CUDA a head_dim
            other than 64/128, fp32, block_size < 8, ``query``/caches not 16-byte aligned (data
            pointer and strides multiples of 8 elements), ``out`` not 4-byte aligned, or cache
            strides >= 2^31. CPU value checks: ``query_start_loc``
            decreasing or past T, negative ``seq_lens``, a request needing more block-table
            columns than ``max_blocks`` (EDGE_CASES B1; exactly at capacity is fine), a negative or
            out-of-range block id in a needed column. CUDA cannot raise on values without a host
            sync: keys past the table's capacity are invisible there, and bad block ids are read
            as zeros (no out-of-bounds access; results unspecified). ``PEAGLE_DEBUG_CHECKS=1``
            runs the CPU checks first.
    """
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(query.shape[-1])
    if out is None:
        out = torch.empty_like(query)
    if return_lse and lse is None:
        lse = torch.empty(query.shape[0], query.shape[1], dtype=torch.float32, device=query.device)
    args = [
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
        float(softmax_scale), int(max_query_len), out, lse if return_lse else None,
        int(window_left), sinks, int(num_splits),
    ]  # fmt: skip
    _debug_check_on_cpu(_ops.paged_attention.default, args)
    _ops.paged_attention.default(*args)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# verify_chain
# ---------------------------------------------------------------------------------------------


class VerifyOutput(NamedTuple):
    output_token_ids: torch.Tensor  # [B, max_n + 1] int32, emitted tokens then -1
    num_accepted: torch.Tensor  # [B] int32
    accepted_per_position: torch.Tensor | None  # [B, max_n] bool


def verify_chain(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    *,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    request_mask: torch.Tensor | None = None,
    bonus_token_ids: torch.Tensor | None = None,
    exponentials: torch.Tensor | None = None,
    max_num_draft_tokens: int | None = None,
    return_accepted_per_position: bool = False,
    out: VerifyOutput | None = None,
) -> VerifyOutput:
    """Tree-free (chain) speculative verification straight from target logits (SPEC §6).

    Layout: request ``r`` has ``n_r = cu[r] - cu[r-1]`` drafts (``cu[-1] = 0``) and owns the
    ``n_r + 1`` consecutive logits rows ``[cu[r-1] + r, cu[r] + r]``: its draft rows, then its
    bonus row.

    Greedy requests (``temperature == 0``) accept draft ``j`` iff it equals the first-index argmax
    of row ``j``'s logits; the first mismatch emits that argmax; if all are accepted the bonus
    row's argmax is emitted. They are never divided by the temperature; top-k/top-p do not apply.
    NaN logits count as -inf; a row with no logit above -inf (e.g. all NaN) has argmax 0.

    Non-finite logits (SPEC §6.7, both modes): a row whose maximum is +inf is one-hot at its
    **first** +inf index ``f`` (not an even split over several +inf ids): a draft ``f`` is accepted
    (random rows: iff ``q(f) > 0`` and ``u <= 1 / q(f)``), any other draft is rejected and ``f``
    is emitted, a bonus row emits ``f``.

    Random requests use scores ``s = logit * (1.0f / T)`` (float32; NaN counts as -inf).
    Top-k (``k = top_k[r]``, off if 0 or >= V) keeps ``s >= `` the k-th largest score (ties at the
    threshold kept, as vLLM); then top-p (``top_p[r]``, off if 1) keeps ``v`` iff the kept
    probability mass of tokens with a strictly greater score is ``< top_p`` (vLLM's rule for
    distinct values; the maximum is always kept). ``p = softmax`` over the kept tokens (others
    and -inf logits exactly 0). Draft ``x`` is accepted iff ``0 <= x < V``, ``p(x) > 0``,
    ``q(x) > 0`` and ``u <= p(x) / q(x)`` (float64), with ``q = draft_probs[row]`` (``q == 1``
    when ``draft_probs`` is None, i.e. argmax drafting). At the first rejection only, the
    recovered token is drawn from ``normalize(max(p - q, 0))`` (``p`` with ``x`` removed when
    ``draft_probs`` is None) by inverse-CDF sampling in vocabulary order (the first ``v`` whose
    cumulative weight exceeds ``u * sum``); if every draft is accepted, the bonus token is drawn
    from ``p`` of the bonus row the same way. An empty residual falls back to the argmax of ``p``
    (ties to the lowest index), and every sampled id is in ``[0, V)``.

    vLLM parity (both optional, SPEC §6.4-6.6): ``bonus_token_ids`` replaces the bonus token of
    every request whose drafts are all accepted (greedy and random; the bonus rows are then never
    read, so they may hold anything); ``exponentials`` replaces the inverse-CDF draw of the
    recovered token by vLLM 0.28's exponential race: ``argmax_v residual(v) / E[r, v]`` with ``E =
    exponentials`` (float32, vLLM's ``prob * q.reciprocal()``; v0.16 divided, which differs only on
    1-ULP near-ties; ``residual = p`` with the draft removed for argmax drafts, ``max(p - q, 0)``
    with ``draft_probs``; only ``residual > 0`` competes; ties to the lowest index; an all-zero
    residual falls back to the argmax of ``p`` where vLLM returns token 0 — peagle's SPEC §6.4 rule,
    reachable only when ``q(x) = 0`` and ``p = q``). With ``uniforms`` as well, every random draw
    comes from the caller, as in vLLM's rejection sampler.

    Randomness (Philox4x32-10, same words on CPU and CUDA): key ``(lo32(seed), hi32(seed))``,
    counter ``(lo32(offset), hi32(offset), index, stream)``. Stream 0 (acceptance): index = draft
    position ``j`` in the request, ``u = ((w0 >> 5) * 2^26 + (w1 >> 6)) / 2^53``. Stream 1
    (recovered) and 2 (bonus): one draw at index 0, same formula. A request's draws depend only on
    its own seed, offset and draft count; requests with 0 drafts use no acceptance draws. The op
    never modifies ``seeds`` / ``offsets``: **advance each request's offset by 1 per step** (never
    reuse a (seed, offset) pair). A caller that samples drafts itself must draw that noise outside
    streams 0-2 of the same (seed, offset) (EDGE_CASES X5: reusing the acceptance draw biases the
    output toward q). Not bit-compatible with vLLM's torch generators; pass ``uniforms`` to inject
    the acceptance draws.

    CPU and CUDA agree exactly on greedy rows and on random rows except where float rounding of
    the normaliser or of a sampled token's cumulative weight flips a comparison (SPEC §0.1: <= 0.1%
    of rows): the CPU op sums ``exp(s - m)`` in fp64, the CUDA kernels sum
    ``2^(s log2 e - m log2 e)`` (MUFU.EX2) in fp32 (fp64 across 2048-token tiles) and keep
    top-k/top-p masses in 2^-32 fixed point; CUDA results are bit-identical run to run.

    CUDA outline: 2-3 kernels, the later ones programmatic dependent launches (set
    ``PEAGLE_DISABLE_PDL=1`` for plain launches): (1) every logits row read once, split over
    CTAs: argmax and online normaliser; (2) only with ``top_k``/``top_p``: each filtered row read
    once more, keys above a provable bound collected (up to 4096 per row, fewer beyond 4096
    rows; on overflow, ``top_k`` > 256 on a large vocabulary, or a top-p cut that may lie below
    the bound: radix passes over the row) and the threshold selected exactly; (3) per request:
    the acceptance chain, the outputs, and the one sampled row split over CTAs: tile masses in
    parallel, then the last CTA finds the tile and the token holding ``u * sum``.

    Args:
        target_logits: ``[R, V]`` bf16/fp16/fp32 with ``R = T + B``; unit stride along V, the row
            stride may exceed V.
        draft_token_ids: ``[T]`` int32 drafts, request by request (ids outside ``[0, V)`` are
            rejected without being used as an index).
        cu_num_draft_tokens: ``[B]`` int32 inclusive cumsum of draft counts (0 drafts allowed).
        temperature: ``[B]`` fp32; 0 = greedy.
        seeds, offsets: ``[B]`` int64 Philox seed and counter offset per request.
        top_k: ``[B]`` int32 (0 or >= V = off); top_p: ``[B]`` fp32 in (0, 1] (1 = off).
        draft_probs: ``[T, V]`` fp32 probabilities the drafts were sampled from (None = argmax
            drafts); unit stride along V.
        uniforms: ``[T]`` float64 acceptance draws overriding Philox (tests, vLLM parity).
        request_mask: ``[B]`` bool; False rows (CUDA-graph padding) emit nothing and their
            per-request values are never read.
        bonus_token_ids: ``[B]`` int32 bonus tokens sampled outside (vLLM's sampler output);
            emitted as given (the CPU op checks ``0 <= id < V`` for real requests).
        exponentials: ``[B, V]`` fp32 ``Exp(1)`` draws, one row per request (vLLM's ``q``); unit
            stride along V.
        max_num_draft_tokens: output width minus one; default: max draft count (host sync).
        return_accepted_per_position: also return ``[B, max_n]`` bool, ``j < num_accepted``.
        out: preallocated outputs, fully overwritten (never accumulated).

    Returns:
        :class:`VerifyOutput`: ``output_token_ids [B, max_n + 1]`` int32 (emitted tokens, then
        -1), ``num_accepted [B]`` int32 (a real request emits ``num_accepted + 1`` tokens), and
        ``accepted_per_position`` or None. Masked rows: all -1, 0, False.

    Raises:
        RuntimeError: shape/dtype/device mismatch (naming the argument); on CPU also
            inconsistent ``cu_num_draft_tokens`` (decreasing, not ending at T), more drafts than
            ``max_n``, a negative/non-finite temperature, ``top_k < 0``, ``top_p`` outside
            (0, 1] or a ``bonus_token_ids`` entry outside ``[0, V)``. The CUDA op clamps instead
            (set ``PEAGLE_DEBUG_CHECKS=1`` to validate).
    """
    b = cu_num_draft_tokens.shape[0]
    if out is None:
        if max_num_draft_tokens is None:
            if b == 0:
                max_num_draft_tokens = 0
            else:
                counts = torch.diff(
                    cu_num_draft_tokens.long(), prepend=cu_num_draft_tokens.new_zeros(1)
                )
                max_num_draft_tokens = int(counts.max().item())
        dev = target_logits.device
        out = VerifyOutput(
            torch.empty(b, max_num_draft_tokens + 1, dtype=torch.int32, device=dev),
            torch.empty(b, dtype=torch.int32, device=dev),
            torch.empty(b, max_num_draft_tokens, dtype=torch.bool, device=dev)
            if return_accepted_per_position
            else None,
        )
    args = [
        target_logits, draft_token_ids, cu_num_draft_tokens, temperature, seeds, offsets,
        out.output_token_ids, out.num_accepted, top_k, top_p, draft_probs, uniforms,
        request_mask, out.accepted_per_position, bonus_token_ids, exponentials,
    ]  # fmt: skip
    _debug_check_on_cpu(_ops.verify_chain.default, args)
    _ops.verify_chain.default(*args)
    return out


# ---------------------------------------------------------------------------------------------
# Fake (meta) kernels: every op mutates caller-provided outputs and returns nothing, so the
# fakes only have to exist (shape checks happen in the real kernels); torch.compile traces the
# ops through auto-functionalization.
# ---------------------------------------------------------------------------------------------


def _register_fakes() -> None:
    for name in (
        "prepare_next_token_ids",
        "prepare_draft_inputs",
        "prepare_draft_inputs_workspace",
        "write_kv_cache",
        "paged_attention",
        "verify_chain",
    ):

        def _fake(*args, **kwargs):  # noqa: ARG001
            return None

        torch.library.register_fake(f"peagle::{name}")(_fake)


_register_fakes()
