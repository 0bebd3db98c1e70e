"""KV block allocator of the decode loop (EDGE_CASES C7: blocks allocated == blocks written).

Block 0 is the null block (``peagle.models.paged.NULL_BLOCK_ID``): never handed out, used to pad
block tables. A request *reserves* at admission the blocks its longest possible sequence needs (so
it can never run out mid-flight) but *allocates* them only when a forward is about to write the
positions they hold, and returns all of them when it finishes.
"""

from __future__ import annotations

import torch

from peagle.models.paged import NULL_BLOCK_ID


def blocks_for(num_positions: int, block_size: int) -> int:
    return -(-max(num_positions, 0) // block_size)


class BlockAllocator:
    """Free list over blocks ``1 .. num_blocks-1`` plus a reservation counter."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"need >= 2 KV blocks (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = [b for b in range(num_blocks - 1, -1, -1) if b != NULL_BLOCK_ID]
        self._reserved = 0

    @property
    def num_free(self) -> int:
        """Blocks neither allocated nor reserved."""
        return len(self._free) - self._reserved

    @property
    def num_allocated(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def reserve(self, n: int) -> bool:
        """Reserve ``n`` blocks for later :meth:`allocate`; False if not enough are free."""
        if n > self.num_free:
            return False
        self._reserved += n
        return True

    def unreserve(self, n: int) -> None:
        assert 0 <= n <= self._reserved
        self._reserved -= n

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` previously reserved blocks."""
        assert 0 <= n <= self._reserved, (n, self._reserved)
        self._reserved -= n
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


def default_num_blocks(
    bytes_per_token: int, block_size: int, max_blocks: int, device: torch.device,
    budget: int | None,
) -> int:  # fmt: skip
    """KV blocks per cache that fit ``budget`` bytes for both caches (default: 70% of the free
    device memory on CUDA, 1 GiB on CPU), at most ``max_blocks`` and at least 2."""
    if budget is None:
        if device.type == "cuda":
            budget = int(0.7 * torch.cuda.mem_get_info(device)[0])
        else:
            budget = 1 << 30
    fits = budget // (bytes_per_token * block_size)
    return int(max(2, min(max_blocks, fits)))
