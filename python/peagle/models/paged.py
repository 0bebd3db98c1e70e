"""Paged KV cache storage and the attention call shared by the target runner and the drafter.

Both models keep their K/V in ``[num_blocks, block_size, Hkv, D]`` caches (SPEC.md §5), one pair per
layer, addressed through a per-request block table. Block 0 is reserved as the *null block*: block
tables are padded with it, nothing is ever written to it (every write goes through a slot mapping
whose real entries point at allocated blocks), so reads past a request's allocated blocks (the
rejected tail rows of a drafter batch, SPEC §3.6) stay inside the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peagle import ops

NULL_BLOCK_ID = 0


@dataclass
class AttentionMetadata:
    """Per-forward attention inputs (all on the model's device).

    Attributes:
        positions: ``[T]`` int64 absolute (RoPE) positions.
        slot_mapping: ``[T]`` int64 KV slot per row (``PADDING_SLOT_ID`` = -1: no write).
        query_start_loc: ``[B+1]`` int32 rows of request ``r`` are ``[qsl[r], qsl[r+1])``.
        seq_lens: ``[B]`` int32 KV length per request including this forward's rows (0 = padding).
        block_table: ``[B, max_blocks]`` int32, padded with :data:`NULL_BLOCK_ID`.
        max_query_len: upper bound on rows per request (a launch hint; -1 = unknown).
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int = -1


class PagedKVCache:
    """K and V caches of one model: ``num_layers`` pairs of ``[num_blocks, block_size, Hkv, D]``.

    One contiguous ``[num_layers, 2, num_blocks, block_size, Hkv, D]`` allocation; the per-layer
    key/value caches are views of it.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"a KV cache needs >= 2 blocks (block 0 is the null block), got {num_blocks}"
            )
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.storage = torch.zeros(
            num_layers,
            2,
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            dtype=dtype,
            device=device,
        )

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.storage[i, 0], self.storage[i, 1]

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()


def rope_cos_sin(
    rotary_emb: torch.nn.Module, like: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[T, D]`` from a transformers rotary module, computed from the positions
    themselves (no table lookup: positions past ``max_position_embeddings`` are safe, EDGE C6)."""
    cos, sin = rotary_emb(like, positions.view(1, -1))
    return cos[0], sin[0]


def paged_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    *,
    softmax_scale: float,
    window_left: int = -1,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write this forward's K/V rows into the paged cache, then attend causally over it.

    Args:
        query: ``[T, Hq, D]``; key, value: ``[T, Hkv, D]`` (after RoPE for q/k).
        kv: the layer's ``(key_cache, value_cache)``.
        window_left: keys visible to the left of each row's own (-1 = all).
        sinks: optional ``[Hq]`` fp32 per-head sink logits (GPT-OSS).

    Returns:
        ``[T, Hq, D]`` attention output (rows that see no key are 0).
    """
    key_cache, value_cache = kv
    ops.write_kv_cache(key, value, key_cache, value_cache, meta.slot_mapping)
    return ops.paged_attention(
        query,
        key_cache,
        value_cache,
        meta.block_table,
        meta.query_start_loc,
        meta.seq_lens,
        softmax_scale=softmax_scale,
        max_query_len=meta.max_query_len,
        window_left=window_left,
        sinks=sinks,
    )
