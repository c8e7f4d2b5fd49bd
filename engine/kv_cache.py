"""The paged KV cache tensors: one flat slot array per layer for keys and one for values.

Keys are stored after RoPE (the attention function receives rotated keys), so a cached token
keeps its position. Sized from a byte budget with exact accounting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """Keys and values, all layers, one token."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    @classmethod
    def of(cls, config: object, dtype: torch.dtype) -> KVShape:
        heads = int(getattr(config, "num_attention_heads"))  # noqa: B009 - config objects are untyped
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        hidden = int(getattr(config, "hidden_size"))  # noqa: B009
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        return cls(int(getattr(config, "num_hidden_layers")), kv_heads, head_dim, dtype)  # noqa: B009


class KVCache:
    def __init__(self, shape: KVShape, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.shape = shape
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        size = (shape.num_layers, self.num_slots, shape.num_kv_heads, shape.head_dim)  # (L, S, KVH, D)
        self.keys = torch.zeros(size, dtype=shape.dtype, device=device)
        self.values = torch.zeros(size, dtype=shape.dtype, device=device)

    @property
    def bytes_per_block(self) -> int:
        return self.shape.bytes_per_token * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Stores the step's new tokens: `slots` (T,), key/value (T, KVH, D)."""
        self.keys[layer].index_copy_(0, slots, key.to(self.keys.dtype))
        self.values[layer].index_copy_(0, slots, value.to(self.values.dtype))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's keys and values in token order, shaped (1, KVH, L, D) for attention."""
        key = self.keys[layer].index_select(0, slots)  # (L, KVH, D)
        value = self.values[layer].index_select(0, slots)
        return key.permute(1, 0, 2).unsqueeze(0), value.permute(1, 0, 2).unsqueeze(0)


def slots_of(table: list[int], num_tokens: int, block_size: int, start: int = 0) -> torch.Tensor:
    """Flat slot indices (long) of tokens [start, num_tokens) of a sequence with this block table."""
    blocks = torch.tensor(table[start // block_size : -(-num_tokens // block_size)], dtype=torch.long)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()  # (nb * bs,)
    offset = start - start // block_size * block_size
    return slots[offset : offset + num_tokens - start]
