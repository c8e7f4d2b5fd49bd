"""Quantised KV blocks: asymmetric (min/scale) integer storage, as in KIVI.

Keys are quantised per channel over the tokens of one block (key outliers live in channels);
values per token over their channels. 8-bit codes take a byte each; 4-bit codes are packed two to
a byte (the low nibble holds the first half of the channels, the high nibble the second half);
6-bit codes take three quarters of a byte: their low four bits packed as 4-bit codes are, then
their top two bits four to a byte (byte j: channels j, j + D/4, j + D/2, j + 3D/4 from its low
bits up), so that a reader takes 16 channels of either part with one load.
Scales and minimums are kept in the cache's dtype (a store keeps min + zero * scale, the offset of
centred codes). Everything here is plain torch on whatever device the cache lives on; no host
round-trip. On CPU the store is read by `kv_native` instead, and `read_rows` is its reference.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

Quantized = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes, scale, min


@dataclass(frozen=True)
class QuantFormat:
    bits: int  # 8, 6 or 4

    def __post_init__(self) -> None:
        if self.bits not in (4, 6, 8):
            raise ValueError(f"KV quantisation supports 8, 6 or 4 bits, got {self.bits}")

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def zero(self) -> int:
        """The middle code, subtracted before codes enter a matmul (see `centred`)."""
        return 1 << (self.bits - 1)

    @property
    def storage_dtype(self) -> torch.dtype:
        """8-bit codes are stored centred, as int8, ready to enter a matmul; 6- and 4-bit ones packed."""
        return torch.int8 if self.bits == 8 else torch.uint8

    def code_dim(self, head_dim: int) -> int:
        """Bytes of codes per head and token."""
        if self.bits == 4 and head_dim % 2:
            raise ValueError(f"4-bit KV needs an even head dimension, got {head_dim}")
        if self.bits == 6 and head_dim % 4:
            raise ValueError(f"6-bit KV needs a head dimension divisible by 4, got {head_dim}")
        return head_dim * self.bits // 8

    def bytes_per_block(self, head_dim: int, block_size: int, scale_bytes: int) -> int:
        """Exact bytes of one block of one KV head in one layer, keys and values: the codes, each
        token's value (scale, min) and the block's key (scale, min) per channel."""
        per_token = 2 * self.code_dim(head_dim) + 2 * scale_bytes
        return block_size * per_token + 2 * head_dim * scale_bytes


def layer_formats(
    num_layers: int, bits: int, int8_layers: tuple[int, ...] = (), int6_layers: tuple[int, ...] = ()
) -> tuple[QuantFormat, ...]:
    """Each layer's format: `bits`, but 8 in `int8_layers` and 6 in `int6_layers`."""
    for name, named in (("KV_INT8_LAYERS", int8_layers), ("KV_INT6_LAYERS", int6_layers)):
        if beyond := [layer for layer in named if layer >= num_layers]:
            raise ValueError(f"{name} names layers {beyond}; the model has {num_layers} (0-{num_layers - 1})")
    if both := sorted(set(int8_layers) & set(int6_layers)):
        raise ValueError(f"layers {both} are named both in KV_INT8_LAYERS and in KV_INT6_LAYERS")
    return tuple(
        QuantFormat(8 if layer in int8_layers else 6 if layer in int6_layers else bits)
        for layer in range(num_layers)
    )


def _pack(codes: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    if fmt.bits == 8:
        return codes
    half = codes.shape[-1] // 2
    low = codes & 0x0F if fmt.bits == 6 else codes
    nibbles = low[..., :half] | (low[..., half:] << 4)
    if fmt.bits == 4:
        return nibbles
    top = (codes >> 4).reshape(*codes.shape[:-1], 4, -1)  # (..., 4, D/4): quarter q of the channels
    pairs = top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6)
    return torch.cat((nibbles, pairs), dim=-1)


def unpack(packed: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    if fmt.bits == 8:
        return packed
    if fmt.bits == 4:
        return torch.cat((packed & 0x0F, packed >> 4), dim=-1)
    quarter = packed.shape[-1] // 3  # D/4: the nibbles take 2 D/4 bytes, the top bits D/4
    nibbles, pairs = packed[..., : 2 * quarter], packed[..., 2 * quarter :]
    top = torch.cat([(pairs >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=-1)
    return torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1) | (top << 4)


class Parts(NamedTuple):
    """Where each KV head's codes lie in one block of a stored layer's keys (or values): per head,
    its bits and the byte its (block_size, C) codes start at; and the bytes of a block. CPU int64
    tensors, so that the native kernel reads them where they lie."""

    bits: torch.Tensor  # (KVH,)
    starts: torch.Tensor  # (KVH,)
    stride: int


@dataclass(frozen=True)
class LayerFormat:
    """One layer's formats per KV head: its keys' and its values'. A KV head's keys are quantised
    per channel over a block and its values per token, each head on its own, so each of these
    parts may hold its own bits; a stored block holds its heads' codes one after another, each in
    its part's format (all heads alike: the layout of one (block, KVH, block_size, C) tensor)."""

    keys: tuple[QuantFormat, ...]
    values: tuple[QuantFormat, ...]

    def __post_init__(self) -> None:
        if not self.keys or len(self.keys) != len(self.values):
            raise ValueError(f"{len(self.keys)} key and {len(self.values)} value formats for one layer")

    @classmethod
    def uniform(cls, fmt: QuantFormat, kv_heads: int) -> LayerFormat:
        return cls((fmt,) * kv_heads, (fmt,) * kv_heads)

    def parts(self, values: bool) -> tuple[QuantFormat, ...]:
        return self.values if values else self.keys

    def alike(self, values: bool) -> QuantFormat | None:
        """The format every head's keys (values) share, or None where heads differ."""
        parts = self.parts(values)
        return parts[0] if len(set(parts)) == 1 else None

    @property
    def lowest_bits(self) -> int:
        return min(f.bits for f in (*self.keys, *self.values))

    def code_bytes(self, values: bool, head_dim: int, block_size: int) -> int:
        """Bytes of one block's codes, every head's keys (values)."""
        return block_size * sum(f.code_dim(head_dim) for f in self.parts(values))

    def starts(self, values: bool, head_dim: int, block_size: int) -> list[int]:
        """The byte each head's keys (values) start at within a block."""
        widths = [block_size * f.code_dim(head_dim) for f in self.parts(values)]
        return [sum(widths[:head]) for head in range(len(widths))]

    def layout(self, values: bool, head_dim: int, block_size: int) -> Parts:
        bits = torch.tensor([f.bits for f in self.parts(values)], dtype=torch.long)
        starts = torch.tensor(self.starts(values, head_dim, block_size), dtype=torch.long)
        return Parts(bits, starts, self.code_bytes(values, head_dim, block_size))

    def bytes_per_block(self, head_dim: int, block_size: int, scale_bytes: int) -> int:
        """Exact bytes of one block in this layer, every KV head, keys and values: the codes, each
        token's value (scale, offset) and the block's key (scale, offset) per channel."""
        heads = len(self.keys)
        scales = heads * (2 * block_size + 2 * head_dim) * scale_bytes
        codes = self.code_bytes(False, head_dim, block_size) + self.code_bytes(True, head_dim, block_size)
        return codes + scales


def part_formats(
    formats: Sequence[QuantFormat], kv_heads: int, parts: Mapping[tuple[int, int, bool], int]
) -> tuple[LayerFormat, ...]:
    """Each layer's `LayerFormat`: its format (`layer_formats`) for every head's keys and values,
    but `parts[(layer, KV head, values?)]` bits for those parts."""
    layers = len(formats)
    if beyond := sorted(part for part in parts if not (0 <= part[0] < layers and 0 <= part[1] < kv_heads)):
        raise ValueError(f"KV parts {beyond} lie outside the model's {layers} layers x {kv_heads} KV heads")

    def kind(layer: int, values: bool) -> tuple[QuantFormat, ...]:
        return tuple(
            QuantFormat(parts[(layer, head, values)]) if (layer, head, values) in parts else formats[layer]
            for head in range(kv_heads)
        )

    return tuple(LayerFormat(kind(layer, False), kind(layer, True)) for layer in range(layers))


def head_codes(codes: torch.Tensor, fmt: LayerFormat, head: int, values: bool, head_dim: int) -> torch.Tensor:
    """One KV head's stored codes (..., blocks, block_size, C) out of a layer's (..., blocks, bytes
    a block), viewed in its format's storage dtype."""
    part = fmt.parts(values)[head]
    width = part.code_dim(head_dim)
    block_size = codes.shape[-1] // fmt.code_bytes(values, head_dim, 1)
    start = fmt.starts(values, head_dim, block_size)[head]
    section = codes[..., start : start + block_size * width]
    return section.view(*section.shape[:-1], block_size, width).view(part.storage_dtype)


def centred(packed: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """The codes minus `fmt.zero`, as int8: x = code * s + m = (code - zero) * s + (m + zero * s).
    Centred, 8-bit codes are stored as int8 and every element reads with one multiply-add against
    a stored offset; the offset also stays near the values, not at their far end, in bf16."""
    if fmt.bits == 8:
        return torch.bitwise_xor(packed, 0x80).view(torch.int8)  # code - 128, bit for bit
    return unpack(packed, fmt).view(torch.int8) - fmt.zero


def to_storage(packed: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Codes as `quantize_*` returns them -> the form a cache stores (`fmt.storage_dtype`)."""
    return centred(packed, fmt) if fmt.bits == 8 else packed


def stored_centred(stored: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Stored codes (see `to_storage`) -> centred codes, as int8; no work at all for 8 bits."""
    return stored if fmt.bits == 8 else centred(stored, fmt)


def _quantize(x: torch.Tensor, dim: int, fmt: QuantFormat) -> Quantized:
    work = x.float()
    low = work.amin(dim=dim, keepdim=True)
    scale = (work.amax(dim=dim, keepdim=True) - low) / fmt.levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant run: any scale is exact
    codes = torch.round((work - low) / scale).clamp_(0, fmt.levels).to(torch.uint8)
    return _pack(codes, fmt), scale.to(x.dtype), low.to(x.dtype)


def quantize_keys(keys: torch.Tensor, fmt: QuantFormat) -> Quantized:
    """keys (..., block_size, KVH, D) -> codes (..., block_size, KVH, C), scale and min (..., KVH, D)."""
    codes, scale, low = _quantize(keys, -3, fmt)
    return codes, scale.squeeze(-3), low.squeeze(-3)


def quantize_values(values: torch.Tensor, fmt: QuantFormat) -> Quantized:
    """values (..., KVH, D) -> codes (..., KVH, C), scale and min (..., KVH)."""
    codes, scale, low = _quantize(values, -1, fmt)
    return codes, scale.squeeze(-1), low.squeeze(-1)


class StoredLayer(NamedTuple):
    """One layer of a quantised store, as `ColdStore` keeps it, rows being (block, KV head).
    Every element reads as `centred code * scale + offset`, the offset being min + zero * scale.
    A block's codes are its KV heads' (block_size, C) codes one after another, each head in its
    part's format (`LayerFormat`), as bytes: 8-bit codes centred (int8 bit patterns)."""

    key_codes: torch.Tensor  # (blocks, bytes a block) uint8
    key_scale: torch.Tensor  # (blocks, KVH, D): per channel of the block
    key_offset: torch.Tensor  # (blocks, KVH, D)
    value_codes: torch.Tensor  # (blocks, bytes a block) uint8
    value_scale: torch.Tensor  # (blocks, KVH, block_size): per token
    value_offset: torch.Tensor  # (blocks, KVH, block_size)


def hadamard(dim: int, device: torch.device | None = None) -> torch.Tensor:
    """The orthonormal Hadamard matrix of size `dim` (a power of two), fp32: symmetric and its own
    inverse. Rotating keys and values by it before quantising spreads a few large channels over
    all of them (QuaRot), so that one scale fits every channel of a token better."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head dimension, got {dim}")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    rotation: torch.Tensor = (h / dim**0.5).to(device)
    return rotation


def read_rows(layer: StoredLayer, rows: torch.Tensor, fmt: LayerFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (n,) of (block, KV head), dequantised into the store's dtype: keys and values, each
    (n, bs, D). Plain torch on the store's device (the reference for `kv_native`, which does the
    same in one pass on CPU)."""
    heads, dim = layer.key_scale.shape[-2:]
    size, dtype = layer.value_scale.shape[-1], layer.key_scale.dtype

    def codes(t: torch.Tensor, values: bool) -> torch.Tensor:
        alike = fmt.alike(values)
        if alike is not None:  # one format: rows of (block, KV head) are equal slices of a block
            width = alike.code_dim(dim)
            stored = t.reshape(-1, size * width).index_select(0, rows).view(-1, size, width)
            return stored_centred(stored.view(alike.storage_dtype), alike).to(dtype)
        out = torch.empty(rows.shape[0], size, dim, dtype=dtype, device=t.device)
        for head in range(heads):
            part = fmt.parts(values)[head]
            picked = (rows % heads == head).nonzero().squeeze(1)
            stored = head_codes(t, fmt, head, values, dim).index_select(0, rows[picked] // heads)
            out[picked] = stored_centred(stored, part).to(dtype)
        return out

    def per_row(t: torch.Tensor, row_width: int) -> torch.Tensor:
        return t.reshape(-1, row_width).index_select(0, rows)

    key_scale, key_offset = per_row(layer.key_scale, dim)[:, None], per_row(layer.key_offset, dim)[:, None]
    keys = torch.addcmul(key_offset, codes(layer.key_codes, False), key_scale)  # per channel
    value_scale, value_offset = per_row(layer.value_scale, size), per_row(layer.value_offset, size)
    values = torch.addcmul(value_offset[..., None], codes(layer.value_codes, True), value_scale[..., None])
    return keys, values
