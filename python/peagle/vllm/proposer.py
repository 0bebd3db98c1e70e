"""vLLM's P-EAGLE draft-input preparation on ``torch.ops.peagle`` (SPEC.md §3-4).

vLLM 0.28 (``vllm/v1/spec_decode/llm_base_proposer.py``, ``SpecDecodeBaseProposer``) prepares the
drafter batch in three calls from the model runner:

1. ``prepare_next_token_ids_padded`` -> Triton ``eagle_prepare_next_token_padded_kernel``
   (Stage A). Replaced: the kernel launch becomes ``peagle.ops.prepare_next_token_ids``; vLLM's
   host code (backup tokens from the request states) is kept.
2. ``prepare_inputs_padded`` -> Triton ``eagle_prepare_inputs_padded_kernel`` (Stage B) and the
   spec-decode attention metadata. Kept: its rejected counts are the input of step 3.
3. ``propose`` -> ``set_inputs_first_pass`` -> ``copy_and_expand_eagle_inputs_kernel`` (Stage C),
   the hidden-state scatter and mask broadcast, ``compute_new_slot_mapping`` (Stage D) and
   ``extend_all_queries_by_N`` (Stage E). Replaced by one ``peagle.ops.prepare_draft_inputs``.

Step 3 receives Stage A/B *outputs* (``next_token_ids``, ``num_rejected_tokens_gpu``), while the
fused op takes Stage A/B *inputs*. They are passed in the op's input form without loss: a
one-column ``sampled_token_ids = next_token_ids[:, None]`` (valid count 1, so the op's next token
is ``next_token_ids``), no discarded request, and ``cu_num_draft_tokens =
cumsum(num_rejected_tokens_gpu)``, so the op's rejected count ``n_draft + 1 - 1`` equals
vLLM's ``num_rejected_tokens_gpu`` (and 0 rejected rows where vLLM passes None).
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any

import torch

from peagle import ops

# Stage A validity bound for the encoded form above: next_token_ids are already resolved tokens
# (vLLM's own Stage A output), so every non-negative id must stay valid, and the mask id (which
# the op checks against the same bound) may exceed the target vocabulary.
_ANY_TOKEN = 2**31 - 1

# Set while a proposer that uses peagle runs prepare_next_token_ids_padded, so that the Stage A
# kernel stand-in below knows which implementation to run.
_STAGE_A_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "peagle_vllm_stage_a", default=False
)


def set_inputs_first_pass(
    proposer: Any,
    target_token_ids: torch.Tensor,
    next_token_ids: torch.Tensor,
    target_positions: torch.Tensor,
    target_hidden_states: torch.Tensor,
    cad: Any,
    num_rejected_tokens_gpu: torch.Tensor | None,
) -> tuple[int, torch.Tensor, Any]:
    """The parallel-drafting branch of ``SpecDecodeBaseProposer.set_inputs_first_pass``.

    Writes the proposer's persistent buffers exactly where vLLM's code does (``input_ids``,
    ``positions``, ``is_rejected_token_mask``, ``is_masked_token_mask``, ``hidden_states``, rows
    ``[0, T_out)``) and returns ``(T_out, token_indices_to_sample [B*K] int32, new_cad)`` with
    ``new_cad`` built like vLLM's ``extend_all_queries_by_N`` (device ``query_start_loc`` /
    ``seq_lens`` and the int64 ``slot_mapping`` from the op; host ``query_start_loc_cpu`` and
    the scalar maxima computed on the host, no sync).

    Args (as vLLM passes them): ``target_token_ids [T_in]`` int32, ``next_token_ids [B]`` int32,
    ``target_positions [T_in]`` int64, ``target_hidden_states [T_in, H]`` (after the drafter's
    ``combine_hidden_states``), ``cad`` the spec-decode ``CommonAttentionMetadata``,
    ``num_rejected_tokens_gpu [B]`` int32 or None.
    """
    b = cad.batch_size()
    n_new = proposer.net_num_new_slots_per_request  # K - 1
    slots = proposer.extra_slots_per_request  # K
    t_in = target_token_ids.shape[0]
    t_out = t_in + b * n_new
    dev = target_token_ids.device
    i32 = torch.int32

    if num_rejected_tokens_gpu is None:
        cu_rejected = torch.zeros(b, dtype=i32, device=dev)
    else:
        cu_rejected = torch.cumsum(num_rejected_tokens_gpu, 0, dtype=i32)
    next_ids = next_token_ids.to(i32).reshape(b, 1)
    out = ops.DraftInputs(
        input_ids=proposer.input_ids[:t_out],
        positions=proposer.positions[:t_out],
        is_rejected=proposer.is_rejected_token_mask[:t_out],
        is_masked=proposer.is_masked_token_mask[:t_out],
        token_indices_to_sample=torch.empty(b * slots, dtype=i32, device=dev),
        slot_mapping=torch.empty(t_out, dtype=torch.int64, device=dev),
        query_start_loc=torch.empty(b + 1, dtype=i32, device=dev),
        seq_lens=torch.empty(b, dtype=i32, device=dev),
        next_token_ids=torch.empty(b, dtype=i32, device=dev),
        valid_sampled_tokens_count=torch.empty(b, dtype=i32, device=dev),
        hidden_states=proposer.hidden_states[:t_out],
    )
    ops.prepare_draft_inputs(
        target_token_ids,
        target_positions,
        cad.query_start_loc,
        cad.seq_lens,
        next_ids,
        torch.zeros(b, dtype=torch.bool, device=dev),
        next_ids.view(b),
        cu_rejected,
        cad.block_table_tensor,
        num_padding_slots_per_request=slots,
        mask_token_id=proposer.parallel_drafting_token_id,
        block_size=proposer.block_size,
        max_model_len=proposer.max_model_len,
        vocab_size=_ANY_TOKEN,
        target_hidden_states=target_hidden_states,
        mask_hidden=proposer.parallel_drafting_hidden_state_tensor,
        padding_token_id=0,
        shift_input_ids=True,
        out=out,
    )
    qsl_cpu = cad.query_start_loc_cpu
    new_cad = cad.replace(
        query_start_loc=out.query_start_loc,
        query_start_loc_cpu=qsl_cpu + n_new * torch.arange(qsl_cpu.shape[0], dtype=i32),
        seq_lens=out.seq_lens,
        num_actual_tokens=cad.num_actual_tokens + b * n_new,
        max_query_len=cad.max_query_len + n_new,
        max_seq_len=cad.max_seq_len + n_new,
        slot_mapping=out.slot_mapping,
    )
    return t_out, out.token_indices_to_sample, new_cad


def call_supported(
    proposer: Any,
    target_token_ids: torch.Tensor,
    next_token_ids: torch.Tensor,
    target_positions: torch.Tensor,
    target_hidden_states: torch.Tensor,
    cad: Any,
) -> str | None:
    """Why this call cannot use the op (None when it can). Host-side metadata only, no sync."""
    hidden = proposer.hidden_states
    if proposer.parallel_drafting_hidden_state_tensor is None:
        return "the drafter's mask hidden state is not loaded"
    if target_positions.dim() != 1:
        return "positions are not 1-D (M-RoPE / XD-RoPE)"
    if target_token_ids.dtype != torch.int32 or next_token_ids.dtype != torch.int32:
        return "token ids are not int32"
    if target_positions.dtype != torch.int64:
        return f"positions are {target_positions.dtype}, not int64"
    if cad.query_start_loc.dtype != torch.int32 or cad.seq_lens.dtype != torch.int32:
        return "query_start_loc / seq_lens are not int32"
    if target_hidden_states.dtype != hidden.dtype or target_hidden_states.dim() != 2:
        return (
            f"target hidden states are {target_hidden_states.dtype} "
            f"{tuple(target_hidden_states.shape)}, the drafter buffer {hidden.dtype}"
        )
    if cad.block_table_tensor.dtype != torch.int32:
        return f"block table dtype {cad.block_table_tensor.dtype}"
    if target_token_ids.device != hidden.device:
        return "inputs are not on the drafter's device"
    return None


class StageAKernel:
    """Stand-in for vLLM's Stage A launcher in ``llm_base_proposer``.

    Two call styles, by vLLM release: 0.28 launches the Triton kernel
    ``eagle_prepare_next_token_padded_kernel[grid](*args, **kwargs)``; 0.30+ calls the warm-up
    dispatcher ``_eagle_prepare_next_token_padded(*args, **kwargs)`` (the kernel in ``.kernel``,
    same arguments). While a peagle proposer runs ``prepare_next_token_ids_padded`` either one calls
    ``peagle.ops.prepare_next_token_ids``; otherwise the call goes unchanged to what it wraps.
    ``calls`` counts the op launches (the activation log states only what was seen to run).
    """

    def __init__(self, triton_kernel: Any):
        self.triton_kernel = triton_kernel
        self.calls = 0

    def __getitem__(self, grid: Any):
        if not _STAGE_A_ACTIVE.get():
            return self.triton_kernel[grid]
        return functools.partial(self._launch, functools.partial(_triton_launch, grid))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not _STAGE_A_ACTIVE.get():
            return self.triton_kernel(*args, **kwargs)
        return self._launch(None, *args, **kwargs)

    def _launch(self, fallback, *args: Any, **kwargs: Any) -> None:
        if _stage_a_launch(self.triton_kernel, fallback, *args, **kwargs):
            self.calls += 1

    def __getattr__(self, name: str) -> Any:  # e.g. .fn, .run, .kernel, .register_warmup
        return getattr(self.triton_kernel, name)


def _triton_launch(grid, kernel, *args, **kwargs):
    kernel[grid](*args, **kwargs)


def _stage_a_launch(
    launcher: Any,
    fallback: Any,
    sampled_token_ids: torch.Tensor,
    discard_request_mask: torch.Tensor,
    backup_next_token_ids: torch.Tensor,
    next_token_ids: torch.Tensor,
    valid_sampled_tokens_count: torch.Tensor,
    vocab_size: int,
    num_sampled_tokens_per_req: int,
    num_reqs: int,
    stride_sampled_token_ids: int,
    BLOCK_SIZE_TOKENS: int | None = None,  # noqa: N803  (vLLM's Triton launch parameter)
) -> bool:
    """The kernel's argument list (vLLM 0.28's; 0.33's dispatcher takes the same) mapped onto
    ``peagle.ops.prepare_next_token_ids``; True when the op ran.

    vLLM passes whole persistent buffers for the mask and the backup tokens (``max_num_reqs``
    rows); the op gets their first ``num_reqs`` rows. Inputs the op does not take (ids that are
    not int32, tensors on different devices) go to vLLM's launcher instead (``fallback(launcher,
    ...)``, or a plain call of the dispatcher).
    """
    b = int(num_reqs)
    tensors = (sampled_token_ids, discard_request_mask, backup_next_token_ids, next_token_ids,
               valid_sampled_tokens_count)  # fmt: skip
    if (
        sampled_token_ids.dtype != torch.int32
        or backup_next_token_ids.dtype != torch.int32
        or next_token_ids.dtype != torch.int32
        or valid_sampled_tokens_count.dtype != torch.int32
        or discard_request_mask.dtype != torch.bool
        or len({t.device for t in tensors}) != 1
    ):
        args = (sampled_token_ids, discard_request_mask, backup_next_token_ids, next_token_ids,
                valid_sampled_tokens_count, vocab_size, num_sampled_tokens_per_req, num_reqs,
                stride_sampled_token_ids)  # fmt: skip
        if fallback is None:
            launcher(*args, BLOCK_SIZE_TOKENS=BLOCK_SIZE_TOKENS)
        else:
            fallback(launcher, *args, BLOCK_SIZE_TOKENS=BLOCK_SIZE_TOKENS)
        return False
    ops.prepare_next_token_ids(
        sampled_token_ids[:b, : int(num_sampled_tokens_per_req)],
        discard_request_mask[:b],
        backup_next_token_ids[:b],
        int(vocab_size),
        out=(next_token_ids[:b], valid_sampled_tokens_count[:b]),
    )
    return True


def stage_a_active() -> contextvars.ContextVar[bool]:
    """The context variable :class:`StageAKernel` reads (set by the patched method)."""
    return _STAGE_A_ACTIVE
