"""The inputs of one decode step: what the scheduler decided and the device tensors built from it.

A leaf module (numpy and torch only), read by every other part of the loop:

* :class:`StepTensors`: the device inputs of one target pass + verification + drafter phase (in
  the decode loop, views of :class:`~peagle.decode.staging.StepStaging`'s device buffer; the
  static buffers of a CUDA graph are the same views).
* :class:`ScheduledStep`: the requests of a step and each one's row layout (drafts, first
  position, rows), as :meth:`~peagle.decode.scheduler.Scheduler.schedule` returns it.
* :class:`Batch`: a scheduled step with its built :class:`StepTensors`.
* :func:`row_layout`: the index arrays that depend only on each request's row and draft counts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from peagle.decode.request import Request


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
    # [B] int64 request ids (synthetic acceptance's draw keys; only written when it is on)
    request_keys: torch.Tensor | None = None


@dataclass
class ScheduledStep:
    """The running requests of one step in batch order and the rows each one owns (a prefill:
    its prompt; a decode: its last token + ``num_drafts[i]`` draft rows)."""

    reqs: list[Request]
    num_drafts: list[int]  # drafts verified per request
    first_pos: list[int]  # position of the request's first row
    qlens: list[int]  # rows per request
    prefills: list[int]  # batch indices of the requests prefilling this step


@dataclass
class Batch:
    """A scheduled step with its device inputs (``staging``: the
    :class:`~peagle.decode.staging.StepStaging` they are views of)."""

    reqs: list[Request]
    num_drafts: list[int]
    first_pos: list[int]
    qlens: list[int]
    tensors: StepTensors
    staging: object
    b_pad: int | None = None  # CUDA-graph batch size (None: eager step)
    accepted: list[int] | None = None  # set after verification


@dataclass(frozen=True)
class RowLayout:
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
def row_layout(qlens: tuple, ks: tuple, num_real: int) -> RowLayout:
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
    out = RowLayout(
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
