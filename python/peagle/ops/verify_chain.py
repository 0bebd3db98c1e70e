"""``verify_chain``: tree-free (chain) speculative verification straight from target logits.

Semantics: SPEC.md §6 (normative, with peagle's sampling rules in §6.9); the CUDA kernels' design:
docs/architecture.md; the C++ entry is csrc/ops/verify_chain.cpp.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from peagle.ops._common import _debug_check_on_cpu, _ops, register_noop_fakes


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
    """Chain speculative verification straight from target logits (SPEC.md §6).

    Request ``r`` has ``n_r = cu[r] - cu[r-1]`` drafts (``cu[-1] = 0``) and owns the ``n_r + 1``
    consecutive logits rows ``[cu[r-1] + r, cu[r] + r]``: its draft rows, then its bonus row.
    Greedy requests (``temperature == 0``) accept a draft iff it is its row's first-index argmax;
    random requests accept by rejection sampling from the temperature-scaled, top-k/top-p filtered
    softmax and sample the recovered or bonus token themselves. The exact rules (filters,
    acceptance, inverse-CDF sampling, vLLM parity inputs, the Philox counter layout, where CPU and
    CUDA may differ) are SPEC.md §6.9. The op never modifies ``seeds`` / ``offsets``: **advance
    each request's offset by 1 per step**; a caller that samples drafts itself must draw that
    noise outside Philox streams 0-2 of the same (seed, offset) (EDGE_CASES X5). No host sync
    (unless ``max_num_draft_tokens`` is omitted); CUDA-graph safe.

    Non-finite logits (SPEC §6.7, both modes): NaN logits count as -inf (a row with no logit
    above -inf, e.g. all NaN, has argmax 0); a row whose maximum is +inf is one-hot at its
    **first** +inf index ``f`` (not an even split over several +inf ids): a draft ``f`` is
    accepted (random rows: iff ``q(f) > 0`` and ``u <= 1 / q(f)``), any other draft is rejected
    and ``f`` is emitted, a bonus row emits ``f``.

    Parameters:
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

    Example:
        One request, one draft (token 1) and its bonus row, greedy: the draft is the argmax of
        its row, so it is accepted and the bonus row's argmax (2) follows.

        >>> import torch, peagle
        >>> i32, i64 = torch.int32, torch.int64
        >>> logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0]])
        >>> out = peagle.verify_chain(
        ...     logits, torch.tensor([1], dtype=i32), torch.tensor([1], dtype=i32),
        ...     torch.zeros(1), torch.zeros(1, dtype=i64), torch.zeros(1, dtype=i64))
        >>> out.output_token_ids.tolist(), out.num_accepted.tolist()
        ([[1, 2]], [1])
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


register_noop_fakes("verify_chain")
