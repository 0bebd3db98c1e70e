"""Thin wrappers over ``torch.ops.peagle.*`` and their fake (meta) kernels, one module per op.

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

from peagle.ops._common import PADDING_SLOT_ID, PLACEHOLDER_TOKEN_ID
from peagle.ops.paged_attention import paged_attention
from peagle.ops.prepare_draft_inputs import (
    DraftInputs,
    DraftInputsWorkspace,
    empty_draft_inputs,
    num_draft_rows,
    prepare_draft_inputs,
)
from peagle.ops.prepare_next_token_ids import prepare_next_token_ids
from peagle.ops.verify_chain import VerifyOutput, verify_chain
from peagle.ops.write_kv_cache import write_kv_cache

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
