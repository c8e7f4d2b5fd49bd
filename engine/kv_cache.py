"""The paged KV cache tensors: one flat slot array per layer for keys and one for values.

Keys are stored after RoPE (the attention function receives rotated keys), so a cached token
keeps its position. Exact byte accounting; how many blocks of each kind a budget buys is
`kv_policy`'s decision. With KV compression, a `ColdStore` of quantised blocks sits beside the
full-precision slots (see `kv_quant`), read by the native kernel on CPU (`kv_native`) and by
torch elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv_native import NativeKernel
from engine.kv_quant import (
    LayerFormat,
    Parts,
    QuantFormat,
    StoredLayer,
    hadamard,
    quantize_keys,
    quantize_values,
    read_rows,
    to_storage,
)


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


class ColdStore:
    """Quantised blocks for every layer: key codes with a (scale, offset) per block and channel,
    value codes with a (scale, offset) per token. Block `i` here is block `num_hot + i` of the
    pool. Head-major within a block: each KV head's (block_size, C) codes in turn, so that a gather
    of blocks gives each (block, KV head) its tokens contiguously, as the batched matmuls of decode
    attention want them. Stored so that reading does the least work: 8-bit codes already centred
    (int8 bit patterns), and every element is `centred code * scale + offset` with the offset
    (min + zero * scale) computed once, here. Read with the native kernel where one is given
    (CPU), else with torch.

    With `rotate`, keys and values are rotated by a Hadamard matrix over the head dimension before
    they are quantised and rotated back after they are read (`hadamard`): the same bytes, a
    different error.

    Each layer has its format (`formats`; one format stands for every layer), and within a layer
    each KV head's keys and values may hold their own (`LayerFormat`): layers of one format share
    their tensors (`FormatGroup`), so that storing is one quantisation per format and part."""

    def __init__(
        self,
        shape: KVShape,
        fmt: QuantFormat | Sequence[QuantFormat | LayerFormat],
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kernel: NativeKernel | None = None,
        rotate: bool = False,
    ) -> None:
        self.formats = per_layer(fmt, shape.num_layers, shape.num_kv_heads)
        self.rotation = hadamard(shape.head_dim, device) if rotate else None
        self.num_blocks = num_blocks
        self.kernel = kernel
        self.groups = [
            FormatGroup.empty(f, [i for i, g in enumerate(self.formats) if g == f], shape, num_blocks,
                              block_size, device)
            for f in sorted(set(self.formats), key=lambda f: (f.lowest_bits, repr(f)))
        ]  # fmt: skip
        self._where = {layer: (group, i) for group in self.groups for i, layer in enumerate(group.layers)}
        # per format, where each head's codes lie in a block (keys', values'): what the kernel reads
        self._parts = {
            f: (f.layout(False, shape.head_dim, block_size), f.layout(True, shape.head_dim, block_size))
            for f in set(self.formats)
        }

    @property
    def reader(self) -> str:
        """How blocks are read: "native-<isa>" (the C kernel) or "torch"."""
        return f"native-{self.kernel.isa}" if self.kernel is not None else "torch"

    @property
    def lowest_bits(self) -> int:
        return min(f.lowest_bits for f in self.formats)

    def layer(self, layer: int) -> StoredLayer:
        group, i = self._where[layer]
        return StoredLayer(*(t[i] for t in group.tensors))

    def parts(self, layer: int) -> tuple[Parts, Parts]:
        """Where each KV head's key codes and value codes lie in one of the layer's blocks."""
        return self._parts[self.formats[layer]]

    @staticmethod
    def bytes_per_block(
        shape: KVShape, fmt: QuantFormat | Sequence[QuantFormat | LayerFormat], block_size: int
    ) -> int:
        """Exact bytes of one quantised block, every layer in its format."""
        element = torch.empty((), dtype=shape.dtype).element_size()
        formats = per_layer(fmt, shape.num_layers, shape.num_kv_heads)
        return sum(f.bytes_per_block(shape.head_dim, block_size, element) for f in formats)

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for group in self.groups for t in group.tensors)

    def store(self, keys: torch.Tensor, values: torch.Tensor, blocks: torch.Tensor) -> None:
        """Quantises full-precision blocks (L, n, block_size, KVH, D) into cold `blocks` (n,)."""
        keys, values = self._rotated(keys), self._rotated(values)
        if len(self.groups) == 1:  # one format: every layer at once, no copy
            self.groups[0].store(keys, values, blocks)
            return
        for group in self.groups:
            layers = torch.tensor(group.layers, device=keys.device)
            group.store(keys.index_select(0, layers), values.index_select(0, layers), blocks)

    def gathered(self, layer: int, head_blocks: torch.Tensor, pairs: int) -> ColdHistory:
        """Cold blocks as attention reads them, dequantised into the cache's dtype, per (sequence,
        KV head) pair; `head_blocks` (pairs * m,) are rows of (block, KV head) in (sequence, KV
        head, block) order, so that each pair's tokens come out contiguous and in order."""
        stored, fmt = self.layer(layer), self.formats[layer]
        if self.kernel is None:
            keys, values = read_rows(stored, head_blocks, fmt)
        else:
            (key_parts, value_parts), read = self.parts(layer), self.kernel.dequantize_layer
            size, dim = stored.value_scale.shape[-1], stored.key_scale.shape[-1]
            keys = read(stored.key_codes, stored.key_scale, stored.key_offset, head_blocks, key_parts, False,
                        size, dim)  # fmt: skip
            values = read(stored.value_codes, stored.value_scale, stored.value_offset, head_blocks,
                          value_parts, True, size, dim)  # fmt: skip
        dim = keys.shape[-1]
        keys, values = self._rotated(keys), self._rotated(values)  # back: the rotation is its own inverse
        return ColdHistory(keys.view(pairs, -1, dim), values.view(pairs, -1, dim))

    def _rotated(self, x: torch.Tensor) -> torch.Tensor:
        if self.rotation is None:
            return x
        return (x.float() @ self.rotation).to(x.dtype)


def per_layer(
    fmt: QuantFormat | Sequence[QuantFormat | LayerFormat], num_layers: int, kv_heads: int
) -> tuple[LayerFormat, ...]:
    """One format per layer, each head's keys and values alike unless a `LayerFormat` says: a
    single format stands for every layer."""
    formats = (fmt,) * num_layers if isinstance(fmt, QuantFormat) else tuple(fmt)
    if len(formats) != num_layers:
        raise ValueError(f"{len(formats)} KV formats for {num_layers} layers")
    out = tuple(LayerFormat.uniform(f, kv_heads) if isinstance(f, QuantFormat) else f for f in formats)
    if any(len(f.keys) != kv_heads for f in out):
        raise ValueError(f"a layer's KV formats name other than its {kv_heads} KV heads")
    return out


@dataclass(frozen=True)
class FormatGroup:
    """The layers stored in one format, as tensors with a leading dimension over those layers:
    key codes (layers, blocks, bytes a block: each KV head's (block_size, C) in turn) with a
    (scale, offset) per block and channel (layers, blocks, KVH, D); value codes likewise with a
    (scale, offset) per token (layers, blocks, KVH, block_size)."""

    fmt: LayerFormat
    layers: tuple[int, ...]
    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_offset: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_offset: torch.Tensor

    @classmethod
    def empty(
        cls, fmt: LayerFormat, layers: Sequence[int], shape: KVShape, num_blocks: int, block_size: int,
        device: torch.device,
    ) -> FormatGroup:  # fmt: skip
        heads, dim, n = shape.num_kv_heads, shape.head_dim, len(layers)
        key_codes = (n, num_blocks, fmt.code_bytes(False, dim, block_size))
        value_codes = (n, num_blocks, fmt.code_bytes(True, dim, block_size))
        per_channel, per_token = (n, num_blocks, heads, dim), (n, num_blocks, heads, block_size)

        def zeros(size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(size, dtype=dtype, device=device)

        return cls(
            fmt, tuple(layers), zeros(key_codes, torch.uint8), zeros(per_channel, shape.dtype),
            zeros(per_channel, shape.dtype), zeros(value_codes, torch.uint8), zeros(per_token, shape.dtype),
            zeros(per_token, shape.dtype),
        )  # fmt: skip

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """In `StoredLayer`'s order."""
        return (self.key_codes, self.key_scale, self.key_offset, self.value_codes, self.value_scale,
                self.value_offset)  # fmt: skip

    def store(self, keys: torch.Tensor, values: torch.Tensor, blocks: torch.Tensor) -> None:
        """These layers' full-precision blocks (layers, n, block_size, KVH, D) into `blocks` (n,):
        all heads at once where a kind's heads share a format, else a head at a time."""
        heads = keys.shape[-2]
        for kind, x in ((False, keys), (True, values)):
            codes_of, scale_of, offset_of = (
                (self.value_codes, self.value_scale, self.value_offset)
                if kind
                else (self.key_codes, self.key_scale, self.key_offset)
            )
            alike = self.fmt.alike(kind)
            spans = [(0, heads, alike)] if alike is not None else [
                (head, head + 1, part) for head, part in enumerate(self.fmt.parts(kind))
            ]  # fmt: skip
            start = 0
            for first, last, part in spans:
                codes, scale, low = (quantize_values if kind else quantize_keys)(x[..., first:last, :], part)
                # codes (layers, n, bs, heads, C) -> (layers, n, heads * bs * C), head-major
                codes = to_storage(codes, part).transpose(2, 3).flatten(2).view(torch.uint8)
                offset = (low.float() + part.zero * scale.float()).to(scale.dtype)
                if kind:  # (layers, n, bs, heads) -> (layers, n, heads, bs)
                    scale, offset = scale.transpose(2, 3), offset.transpose(2, 3)
                codes_of[..., start : start + codes.shape[-1]].index_copy_(1, blocks, codes)
                scale_of[:, :, first:last].index_copy_(1, blocks, scale.contiguous())
                offset_of[:, :, first:last].index_copy_(1, blocks, offset.contiguous())
                start += codes.shape[-1]


@dataclass(frozen=True)
class ColdHistory:
    """Quantised blocks read for attention, per (sequence, KV head) pair, m * bs tokens each,
    dequantised into the cache's dtype."""

    keys: torch.Tensor  # (pairs, m * bs, D)
    values: torch.Tensor  # (pairs, m * bs, D)


class KVCache:
    def __init__(
        self,
        shape: KVShape,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        cold: ColdStore | None = None,
        kernel: NativeKernel | None = None,
        prompts_in_place: bool = True,
    ) -> None:
        """`kernel`: the native kernel that attends decodes over full-precision slots in place
        (`attention.in_place_attention`), and in bf16 on AVX-512 BF16 or AMX prompt chunks too
        (`prompt_kernel`, unless `prompts_in_place` is False); None: torch gathers them
        (`attention.decode_attention`, and SDPA)."""
        self.shape = shape
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_slots = num_blocks * block_size
        size = (shape.num_layers, self.num_slots, shape.num_kv_heads, shape.head_dim)  # (L, S, KVH, D)
        self.keys = torch.zeros(size, dtype=shape.dtype, device=device)
        self.values = torch.zeros(size, dtype=shape.dtype, device=device)
        self.cold = cold
        self.kernel = kernel
        self.prompts_in_place = prompts_in_place

    @property
    def decode_reader(self) -> str:
        """How decodes read full-precision history: "native-<isa>" (in place) or "torch" (gathered)."""
        if self.kernel is None:
            return "torch"
        return f"native-{self.kernel.decode_isa(self.shape.dtype, self.shape.head_dim)}"

    @property
    def prompt_kernel(self) -> NativeKernel | None:
        """The kernel that attends prompt chunks over their history in place (AMX tiles or AVX-512
        BF16, bf16, head size a multiple of 64: `NativeKernel.prompt_isa`), or None: torch's SDPA
        over a gathered copy."""
        return self.kernel if self._prompt_isa is not None else None

    @property
    def prompt_reader(self) -> str:
        """How prompt chunks read their history: "native-amx-bf16", "native-avx512-bf16" (in
        place) or "torch"."""
        return "torch" if self._prompt_isa is None else f"native-{self._prompt_isa}"

    @property
    def _prompt_isa(self) -> str | None:
        if self.kernel is None or not self.prompts_in_place:
            return None
        return self.kernel.prompt_isa(self.shape.dtype, self.shape.head_dim)

    @property
    def bytes_per_block(self) -> int:
        return self.shape.bytes_per_token * self.block_size

    @property
    def bytes_per_cold_block(self) -> int:
        """Bytes of one quantised block, all layers (0 without a quantised store)."""
        if self.cold is None:
            return 0
        return ColdStore.bytes_per_block(self.shape, self.cold.formats, self.block_size)

    @property
    def total_bytes(self) -> int:
        hot = self.keys.numel() * self.keys.element_size() * 2
        return hot + (self.cold.total_bytes if self.cold is not None else 0)

    def settle(self, hot: torch.Tensor, cold: torch.Tensor) -> None:
        """Quantises full-precision blocks `hot` (n,) into cold blocks `cold` (n,), pool ids."""
        if self.cold is None:
            raise RuntimeError("this cache has no quantised store")
        blocked = (self.shape.num_layers, self.num_blocks, self.block_size, *self.keys.shape[2:])
        keys = self.keys.view(blocked).index_select(1, hot)
        values = self.values.view(blocked).index_select(1, hot)
        self.cold.store(keys, values, cold - self.num_blocks)

    def locate(self, table: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """Where a sequence's first `num_tokens` cached tokens lie: its full-precision slots, and
        its quantised blocks (store ids) with the tokens they hold (None, 0 without a store)."""
        slots = slots_of(table, num_tokens, self.block_size)
        if self.cold is None:
            return slots, None, 0
        blocks = torch.tensor(table[: -(-num_tokens // self.block_size)], dtype=torch.long)
        cold = blocks[blocks >= self.num_blocks] - self.num_blocks
        slots = slots[slots < self.num_slots]  # quantised blocks' slots lie beyond
        return slots, cold, int(cold.numel()) * self.block_size

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Stores the step's new tokens: `slots` (T,), key/value (T, KVH, D)."""
        self.keys[layer].index_copy_(0, slots, key.to(self.keys.dtype))
        self.values[layer].index_copy_(0, slots, value.to(self.values.dtype))

    def read(
        self, layer: int, slots: torch.Tensor, cold_blocks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's keys and values shaped (1, KVH, L, D) for attention: its quantised blocks
        (dequantised) first, then its full-precision slots in token order."""
        key = self.keys[layer].index_select(0, slots).transpose(0, 1)  # (KVH, L, D)
        value = self.values[layer].index_select(0, slots).transpose(0, 1)
        if cold_blocks is not None and self.cold is not None and cold_blocks.numel():
            heads = self.shape.num_kv_heads
            cold = self.cold.gathered(
                layer, head_major_rows(cold_blocks[None, :], heads), heads
            )  # (KVH, m * bs, D)
            key, value = torch.cat((cold.keys, key), dim=1), torch.cat((cold.values, value), dim=1)
        return key.unsqueeze(0), value.unsqueeze(0)


def head_major_rows(index: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a (n, KVH, ...) tensor viewed as (n * KVH, ...) for `index` (B, L) of n, ordered
    (B, KVH, L): one gather then gives each (sequence, KV head) its tokens or blocks in order."""
    head = torch.arange(heads, device=index.device)[None, :, None]
    return (index[:, None, :] * heads + head).flatten()


def slots_of(table: list[int], num_tokens: int, block_size: int, start: int = 0) -> torch.Tensor:
    """Flat slot indices (long) of tokens [start, num_tokens) of a sequence with this block table."""
    blocks = torch.tensor(table[start // block_size : -(-num_tokens // block_size)], dtype=torch.long)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()  # (nb * bs,)
    offset = start - start // block_size * block_size
    return slots[offset : offset + num_tokens - start]
