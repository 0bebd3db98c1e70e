"""Checks of the decode engine's numeric arguments, shared by :class:`SpecDecoder` and the CLI.

A zero ``max_num_seqs`` admits nothing and the loop spins forever; negative sizes fail deep in
tensor allocation. Every bad value is refused up front with a message naming the argument.
"""

from __future__ import annotations

import numbers

import torch

# head_dims the CUDA paged_attention kernels serve (SPEC §5); the CPU kernel serves any.
CUDA_HEAD_DIMS = (64, 128)


def _check_int(name: str, value, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def validate_engine_args(
    *,
    method: str,
    num_speculative_tokens: int,
    max_num_seqs: int,
    max_model_len: int | None,
    block_size: int,
    num_blocks: int | None,
    kv_cache_memory: int | None,
    target=None,
    drafter=None,
    max_num_batched_tokens: int | None = None,
) -> None:
    """Raise ``ValueError`` naming the first bad argument of :class:`SpecDecoder` (and, on CUDA, a
    target or drafter whose head_dim the CUDA attention kernels do not serve: refused here rather
    than at the first decode step)."""
    if method != "none":  # "none" ignores K
        _check_int("num_speculative_tokens", num_speculative_tokens, 1)
    _check_int("max_num_seqs", max_num_seqs, 1)
    _check_int("max_model_len", max_model_len, 2, allow_none=True)  # a prompt token + one more
    _check_int("block_size", block_size, 1)
    _check_int("num_blocks", num_blocks, 1, allow_none=True)
    _check_int("kv_cache_memory", kv_cache_memory, 1, allow_none=True)
    _check_int("max_num_batched_tokens", max_num_batched_tokens, 1, allow_none=True)
    for name, model in (("target", target), ("drafter", drafter if method != "none" else None)):
        _check_cuda_head_dim(name, model)


def _check_cuda_head_dim(name: str, model) -> None:
    if model is None:
        return
    if name == "target":
        device, head_dim = model.device, model.head_dim
    else:
        device = next(model.parameters()).device
        head_dim = model.config.head_dim
    if torch.device(device).type == "cuda" and head_dim not in CUDA_HEAD_DIMS:
        raise ValueError(
            f"the {name} model has head_dim {head_dim}: peagle's CUDA attention serves head_dim "
            f"{' and '.join(map(str, CUDA_HEAD_DIMS))}; run it on the CPU (--device cpu)"
        )
