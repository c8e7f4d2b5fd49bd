"""The KV block pool's bookkeeping: which blocks are free, which sequences use which, which hold
a known prefix.

Pure accounting, no tensors: the pool is `num_blocks` blocks of `block_size` token slots; a
sequence owns a block table (list of block ids) covering its computed tokens. Slot `s` of block
`b` is flat slot `b * block_size + s` in the cache tensors.

Prefix caching: once a block is full of computed tokens it is registered under a hash of its
tokens chained with the hash of everything before it, so the key names the whole prefix. A new
sequence whose leading blocks match adopts them (reference counted) instead of recomputing them;
every analysis prompt starts with the same few hundred tokens of instructions. A freed block keeps
its contents and registration while it sits in the free queue and is evicted least recently freed
first, so "free" still means "available": cached blocks cost nothing when memory is needed.

KV compression adds a second kind of block: ids `[0, num_blocks)` are full-precision ("hot")
blocks, where every new token is written; ids from `num_blocks` on are quantised ("cold") blocks.
`settle` moves a full block from hot to cold, in the table of every sequence that uses it (a
shared prefix block too: left hot, every sharer would pin it for as long as any of them runs); the
caller copies the contents. A prefix registration moves with its block, or stays with the freed
full-precision copy where prompts are read in full precision (KV_PROMPT_TOKENS).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, prefix_caching: bool = True, num_cold_blocks: int = 0
    ) -> None:
        if num_blocks < 1 or block_size < 1 or num_cold_blocks < 0:
            raise ValueError(f"need at least one block of one slot, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.num_cold_blocks = num_cold_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # evict from the front
        self._free_cold: OrderedDict[int, None] = OrderedDict.fromkeys(
            range(num_blocks, num_blocks + num_cold_blocks)
        )
        self._refs = [0] * (num_blocks + num_cold_blocks)
        self._tables: dict[int, list[int]] = {}
        self._hashes: dict[int, list[bytes]] = {}  # per sequence: the keys of its registered full blocks
        self._cached: dict[bytes, int] = {}  # prefix key -> block holding that block of tokens
        self._key_of: dict[int, bytes] = {}  # the inverse, for eviction
        self.num_cache_hits = 0  # blocks adopted instead of computed, since start

    @property
    def num_free(self) -> int:
        """Free full-precision blocks: room for new tokens."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_free_cold(self) -> int:
        return len(self._free_cold)

    @property
    def num_used_cold(self) -> int:
        return self.num_cold_blocks - len(self._free_cold)

    def is_cold(self, block: int) -> bool:
        return block >= self.num_blocks

    def _free_list(self, block: int) -> OrderedDict[int, None]:
        return self._free_cold if block >= self.num_blocks else self._free

    @property
    def num_cached(self) -> int:
        """Blocks whose contents are registered as a reusable prefix (in use or free)."""
        return len(self._cached)

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
        table.extend(self._take(self._free) for _ in range(missing))
        return table

    def _take(self, free: OrderedDict[int, None]) -> int:
        block, _ = free.popitem(last=False)
        key = self._key_of.pop(block, None)
        if key is not None:  # evict: its old contents are about to be overwritten
            del self._cached[key]
        self._refs[block] = 1
        return block

    def is_private(self, seq_id: int) -> bool:
        return all(self._refs[b] == 1 for b in self.table(seq_id))

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Releases the sequence's blocks beyond the first `num_tokens` tokens."""
        table = self._tables[seq_id]
        keep = self.blocks_for(num_tokens)
        self._release(table[keep:])
        del table[keep:]

    def settle(self, hot: int, holders: Sequence[tuple[int, int]], keep_prefix: bool = False) -> int | None:
        """Moves hot block `hot` to a cold block in the tables of `holders` ((sequence, index) of
        every sequence using it) if a cold block is free; returns the cold block for the caller to
        copy into, else None (also when `holders` does not name every user). A prefix registration
        moves with the block; with `keep_prefix` it stays with the full-precision copy, which waits
        among the cached free blocks, so that a prompt adopting the prefix later reads it in full
        precision (until the copy is evicted: then the prefix is computed again)."""
        if hot >= self.num_blocks or self._refs[hot] != len(holders) or not holders or not self._free_cold:
            return None
        cold = self._take(self._free_cold)
        self._refs[cold] = len(holders)
        for seq_id, index in holders:
            self._tables[seq_id][index] = cold
        if not keep_prefix and (key := self._key_of.pop(hot, None)) is not None:
            self._cached[key] = cold
            self._key_of[cold] = key
        self._refs[hot] = 0
        self._free[hot] = None
        if hot not in self._key_of:  # unregistered blocks are reused first, cached ones last
            self._free.move_to_end(hot, last=False)
        return cold

    def adopt_prefix(self, seq_id: int, token_ids: Sequence[int], keys: list[bytes] | None = None) -> int:
        """Gives a sequence without blocks the cached blocks of its longest known prefix.

        Returns the number of tokens whose keys and values are thereby already computed. At least
        one token is always left to compute: its logits give the sequence's next token. `keys`,
        if given, is the sequence's memo of its block keys (see `prefix_keys`).
        """
        if self.table(seq_id):
            return 0
        found = self._known_prefix(token_ids, keys)
        if not found:
            return 0
        for _, block in found:
            if self._refs[block] == 0:
                del self._free_list(block)[block]
            self._refs[block] += 1
        self._tables[seq_id] = [block for _, block in found]
        self._hashes[seq_id] = [key for key, _ in found]
        self.num_cache_hits += len(found)
        return len(found) * self.block_size

    def cached_prefix(self, token_ids: Sequence[int], keys: list[bytes] | None = None) -> int:
        """How many tokens `adopt_prefix` would find computed now (it changes nothing)."""
        return len(self._known_prefix(token_ids, keys)) * self.block_size

    def prefix_keys(self, token_ids: Sequence[int], keys: list[bytes]) -> list[bytes]:
        """The keys of the full blocks before the last token, extending the memo `keys` in place.

        A waiting sequence is looked up every step while it waits; hashing its whole prompt each
        time made scheduling cost grow with the queue times the prompt length. Its tokens only
        ever grow, so the keys computed once stay right."""
        size = self.block_size
        count = (len(token_ids) - 1) // size
        for i in range(len(keys), count):
            keys.append(_block_key(keys[-1] if keys else b"", token_ids[i * size : (i + 1) * size]))
        return keys[:count]

    def _known_prefix(self, token_ids: Sequence[int], keys: list[bytes] | None) -> list[tuple[bytes, int]]:
        if not self.prefix_caching:
            return []
        found: list[tuple[bytes, int]] = []
        for key in self.prefix_keys(token_ids, [] if keys is None else keys):
            block = self._cached.get(key)
            if block is None:
                break
            found.append((key, block))
        return found

    def register(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """Registers the sequence's blocks that are now full of computed tokens as known prefixes."""
        if not self.prefix_caching:
            return
        table = self.table(seq_id)
        keys = self._hashes.setdefault(seq_id, [])
        size = self.block_size
        for i in range(len(keys), min(num_computed // size, len(table))):
            key = _block_key(keys[-1] if keys else b"", token_ids[i * size : (i + 1) * size])
            keys.append(key)
            block = table[i]
            if key not in self._cached and block not in self._key_of:
                self._cached[key] = block
                self._key_of[block] = key

    def free(self, seq_id: int) -> int:
        """Releases every block of the sequence; the number it held. Blocks no one uses return to
        the pool: unregistered ones at the front (reused first), cached ones at the back."""
        table = self._tables.pop(seq_id, [])
        self._hashes.pop(seq_id, None)
        self._release(table)
        return len(table)

    def _release(self, blocks: list[int]) -> None:
        for block in reversed(blocks):  # the tail first: a prefix's deepest blocks are evicted first
            self._refs[block] -= 1
            if self._refs[block] == 0:
                free = self._free_list(block)
                free[block] = None
                if block not in self._key_of:
                    free.move_to_end(block, last=False)


def _block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """A collision-resistant name for a block of tokens and everything before it."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return digest.digest()
