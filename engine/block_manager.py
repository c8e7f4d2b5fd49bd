"""The KV block pool's bookkeeping: which blocks are free, which sequence owns which.

Pure accounting, no tensors: the pool is `num_blocks` blocks of `block_size` token slots; a
sequence owns a block table (list of block ids) covering its computed tokens. Slot `s` of block
`b` is flat slot `b * block_size + s` in the cache tensors.
"""

from __future__ import annotations


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of one slot, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def num_missing(self, seq_id: int, num_tokens: int) -> int:
        """Blocks `seq_id` still needs so that `num_tokens` tokens fit."""
        return max(0, self.blocks_for(num_tokens) - len(self.table(seq_id)))

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        return self.num_missing(seq_id, num_tokens) <= len(self._free)

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grows the sequence's table to hold `num_tokens` tokens; returns the table."""
        missing = self.num_missing(seq_id, num_tokens)
        if missing > len(self._free):
            raise MemoryError(f"sequence {seq_id} needs {missing} blocks, {len(self._free)} free")
        table = self._tables.setdefault(seq_id, [])
        table.extend(self._free.pop() for _ in range(missing))
        return table

    def free(self, seq_id: int) -> int:
        """Returns every block of the sequence to the pool; the number returned."""
        table = self._tables.pop(seq_id, [])
        self._free.extend(reversed(table))
        return len(table)
