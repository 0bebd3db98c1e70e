"""``write_kv_cache``: new K/V rows into the paged cache (SPEC.md §5, normative).

The C++ entry is csrc/ops/write_kv_cache.cpp.
"""

from __future__ import annotations

import torch

from peagle.ops._common import _debug_check_on_cpu, _ops, register_noop_fakes


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V rows into the paged cache (SPEC §5), in place, before attention.

    Parameters:
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

    Example:
        Two blocks of 4 slots, one KV head of size 2; row 1 is a padding row (slot -1).

        >>> import torch, peagle
        >>> kc, vc = torch.zeros(2, 4, 1, 2), torch.zeros(2, 4, 1, 2)
        >>> k = v = torch.ones(2, 1, 2)
        >>> peagle.write_kv_cache(k, v, kc, vc, torch.tensor([5, -1]))
        >>> kc[1, 1].tolist(), float(kc.sum())
        ([[1.0, 1.0]], 2.0)
    """
    args = [key, value, key_cache, value_cache, slot_mapping]
    _debug_check_on_cpu(_ops.write_kv_cache.default, args)
    _ops.write_kv_cache.default(*args)


register_noop_fakes("write_kv_cache")
