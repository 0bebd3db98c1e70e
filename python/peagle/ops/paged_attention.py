"""``paged_attention``: causal attention of ragged query rows over a paged KV cache.

Semantics: SPEC.md §5 (normative); the CUDA kernel's design: docs/architecture.md; the C++ entry
is csrc/ops/paged_attention.cpp.
"""

from __future__ import annotations

import math

import torch

from peagle.ops._common import _debug_check_on_cpu, _ops, register_noop_fakes


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
    """Causal attention of ragged query rows over a paged KV cache (SPEC.md §5).

    Request ``r`` owns query rows ``[qsl[r], qsl[r+1])``; with ``qlen`` rows and ``kv_len =
    seq_lens[r]`` keys (this step's rows included, already written by :func:`write_kv_cache`),
    row ``i`` sees keys ``max(0, kv_len - qlen + i - window_left) <= k <= kv_len - qlen + i``
    (bottom-right aligned causal mask; no lower bound when ``window_left < 0``). Query head ``h``
    reads KV head ``h // (Hq // Hkv)`` (GQA). Scores ``softmax_scale * q.k``, the softmax and the
    weighted sum of V run in fp32; the output is rounded to the input dtype. All rows and heads of
    a request share one pass over its KV pages. Keys a row may not see never affect it, whatever
    they hold (NaN/inf included); a row that sees a non-finite K/V value is not finite (SPEC §5).

    Parameters:
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

    CUDA kernel variants and environment switches (``PEAGLE_DISABLE_PDL``,
    ``PEAGLE_ATTN_IMPL``, ``PEAGLE_ATTN_MERGE``): docs/architecture.md. No host sync; CUDA-graph
    safe.

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

    Example:
        One request of 2 query rows over 3 keys in block 0 (row 0 sees keys 0-1, row 1 keys 0-2).

        >>> import torch, peagle
        >>> i32 = torch.int32
        >>> q, kc, vc = torch.randn(2, 1, 8), torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8)
        >>> out, lse = peagle.paged_attention(
        ...     q, kc, vc, torch.tensor([[0]], dtype=i32), torch.tensor([0, 2], dtype=i32),
        ...     torch.tensor([3], dtype=i32), return_lse=True)
        >>> out.shape, lse.shape
        (torch.Size([2, 1, 8]), torch.Size([2, 1]))
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


register_noop_fakes("paged_attention")
