"""The paged KV cache: one tensor per layer of fixed-size blocks, and the allocator that owns block ids."""

from dataclasses import dataclass

import torch


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.free = list(range(num_blocks - 1, -1, -1))
        self.num_blocks = num_blocks

    def can_allocate(self, n: int) -> bool:
        return len(self.free) >= n

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise MemoryError(f"{n} KV blocks asked, {len(self.free)} free")
        out = self.free[-n:] if n else []
        del self.free[len(self.free) - n:]
        return out[::-1]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free)


@dataclass
class KVCache:
    """k and v [layers, blocks, block_size, kv_heads, head_dim]."""
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, layers: int, blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype, device) -> "KVCache":
        shape = (layers, blocks, block_size, kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @staticmethod
    def bytes_per_block(layers: int, block_size: int, kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
