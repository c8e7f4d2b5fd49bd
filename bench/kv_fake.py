"""A transformers KV cache as the engine's cold store would hold it: fake quantisation and bytes.

A `Format` says how cold blocks are stored (bits for keys and values per layer, rotation, the
residual window, the sink blocks, and the candidate quantisers `bench.kv_formats` searches over);
`logprobs` runs the model over a prompt and its continuation with the cache's cold blocks
quantised and dequantised in place after every step, with the engine's own `quantize_keys` /
`quantize_values`; `bytes_ratio` and `counted_ratio` are the bytes such a store holds. Shared by
`bench.kv_formats` (the search) and `bench.kv_calibration` (what some formats are fitted on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch

from engine.kv_quant import QuantFormat, hadamard, quantize_keys, quantize_values, unpack

BLOCK = 16  # the engine's block size: keys share a scale per channel over one block
PROMPT_CHUNK = 192  # the engine's tokens per step while it reads a prompt
SINK_BLOCKS = 1  # the engine's default: KV_SINK_TOKENS=4, rounded up to a block


@dataclass(frozen=True)
class Format:
    key_bits: int | None = 4  # None: full precision
    value_bits: int | None = 4
    rotate_keys: bool = False
    rotate_values: bool = False
    layer_bits: dict[int, tuple[int | None, int | None]] = field(default_factory=dict)  # layer -> (K, V)
    residual: int = 32
    quantise: bool = True  # False: unquantised (the reference, or the floor)
    prompt_chunk: int = PROMPT_CHUNK
    key_blocks: int = 1  # blocks that share the keys' scales (quantised once all of them are cold)
    layer_key_blocks: dict[int, int] = field(default_factory=dict)  # layer -> its own key_blocks
    sink_blocks: int = SINK_BLOCKS  # first blocks kept full precision
    # Ranges tried per group of values (a token's channels), shrunk about their middle by each
    # ratio, the one with the least squared error kept: same bytes, more work when storing only.
    # Empty: the engine's min-max range.
    value_clips: tuple[float, ...] = ()
    # Keys quantised before rotary embedding (KVQuant's pre-RoPE keys): the cached keys are rotated
    # back to their positions' unrotated form, quantised per channel, dequantised and rotated again.
    # Same bytes; an engine would store them unrotated and rotate after reading.
    pre_rope_keys: bool = False
    # 4-bit codes index 16 levels between a group's min and max fitted to this model's keys and values
    # (Lloyd-Max per layer on calibration documents the evaluation does not use; min and max stay
    # exact), not 16 evenly spaced ones: the same bytes (a 16-entry table per layer and kind), a
    # table lookup when reading.
    codebook: bool = False
    # Per KV head, the `hot_keys` key channels that carry most of the scores' expected error (a
    # channel's mean squared query times its mean squared range over a block, fitted on calibration
    # documents) quantised at `hot_key_bits` instead of the layer's key bits: keys are quantised per
    # channel, so a channel's bits are its own; the query weighs each channel's error in q . k.
    hot_keys: int = 0
    hot_key_bits: int = 8
    # The same number of hot key channels in all, but chosen by weight across every layer and KV
    # head at once (a layer whose keys cost the scores more gets more), not `hot_keys` in each.
    hot_keys_pooled: bool = False
    # Per KV head, the `hot_values` value channels that weigh most in the output (mean squared value
    # times the squared norm of the output projection's columns that read it) kept at full
    # precision; the rest quantised per token over themselves only (a range the outliers no longer
    # set). Dense-and-sparse by fixed channels.
    hot_values: int = 0
    # Dense-and-sparse (KVQuant's outliers, chosen per block here): per block and KV head, the
    # `sparse_keys` key elements and `sparse_values` value elements whose removal narrows their
    # groups' ranges most (greedy: a group's largest or smallest element, gain = the squared range
    # it frees) are kept exact beside the codes (each a value in the cache's dtype and a 16-bit
    # position, counted), and the groups are quantised over what is left.
    sparse_keys: int = 0
    sparse_values: int = 0
    # Per (layer, KV head): its (K, V) bits over the layer's. A KV head's keys and values are
    # quantised on their own (per channel over a block, per token), so each head can hold its own
    # bits: the plain quantiser only.
    head_bits: dict[tuple[int, int], tuple[int | None, int | None]] = field(default_factory=dict)
    # Keys quantised per token over their channels, as values are (QuaRot's layout; with
    # `rotate_keys` the Hadamard rotation spreads the outlier channels over the token's group first),
    # not per channel over a block: a scale and an offset per token (4 bytes) instead of per channel
    # and block (2 x head_dim x 2 / BLOCK: 16 bytes a token at head size 64), which pays for ~1.5
    # more bits of key codes at the same bytes.
    keys_per_token: bool = False
    # With `keys_per_token`: layers whose keys stay per channel over a block all the same (a layer
    # whose keys carry a large constant per channel, as the default model's layer 0 does from its key
    # bias, up to ~145 against a channel's spread of ~0.3-40: one token's range is then that offset's).
    channel_key_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        per_channel_only = self.hot_keys or self.sparse_keys or self.codebook or self.pre_rope_keys
        if self.keys_per_token and (per_channel_only or self.key_blocks != 1 or self.layer_key_blocks):
            raise ValueError("keys_per_token takes the plain quantiser, its scales per token")

    def keys_per_token_in(self, layer: int) -> bool:
        return self.keys_per_token and layer not in self.channel_key_layers

    def bits(self, layer: int, head: int | None = None) -> tuple[int | None, int | None]:
        if head is not None and (layer, head) in self.head_bits:
            return self.head_bits[(layer, head)]
        return self.layer_bits.get(layer, (self.key_bits, self.value_bits))

    def heads_of(self, layer: int) -> bool:
        """Whether some KV head of `layer` holds bits of its own."""
        return any(at == layer for at, _ in self.head_bits)

    def key_group(self, layer: int) -> int:
        return self.layer_key_blocks.get(layer, self.key_blocks)

    def hot_key_choice(self) -> str:
        """Names the choice of hot key channels (count, pooled or not) that this format reads."""
        return f"{self.hot_keys}{' pooled' if self.hot_keys_pooled else ''}"


# included: a group's min and max), a code picking the level nearest (x - min) / (max - min).
Codebooks = dict[int, tuple[torch.Tensor, torch.Tensor]]

# Per layer, (KV heads, head_dim) bool: the key channels a `hot_keys` format holds at its hot bits.
HotChannels = dict[int, torch.Tensor]


def bytes_ratio(fmt: Format, layers: int, head_dim: int, dtype_bytes: int = 2, kv_heads: int = 1) -> float:
    """Cold bytes per token over full precision's, all layers and KV heads (`kv_heads` matters only
    to a format with `head_bits`; without, each head holds the same)."""
    if not fmt.quantise:
        return 1.0
    if any(head >= kv_heads for _, head in fmt.head_bits):
        raise ValueError(f"head_bits names a KV head past the {kv_heads} counted")
    full = 2 * head_dim * dtype_bytes  # one token's key and value
    total = 0.0
    for layer, head in ((layer, head) for layer in range(layers) for head in range(kv_heads)):
        key_bits, value_bits = fmt.bits(layer, head)
        # keys: a scale and an offset per channel and `key_group` blocks; values: per token
        key_scales = (
            2 * dtype_bytes
            if fmt.keys_per_token_in(layer)
            else 2 * head_dim * dtype_bytes / (BLOCK * fmt.key_group(layer))
        )
        if key_bits is not None and key_bits < fmt.hot_key_bits and fmt.hot_keys:
            hot = fmt.hot_keys
            codes = QuantFormat(fmt.hot_key_bits).code_dim(hot) + QuantFormat(key_bits).code_dim(
                head_dim - hot
            )
            total += codes + key_scales
        else:
            total += _part(key_bits, head_dim, dtype_bytes, key_scales)
        if value_bits is not None and fmt.hot_values:
            hot = fmt.hot_values
            total += QuantFormat(value_bits).code_dim(head_dim - hot) + hot * dtype_bytes + 2 * dtype_bytes
        else:
            total += _part(value_bits, head_dim, dtype_bytes, 2 * dtype_bytes)
        # a kept element: its value and its 16-bit position within the block's head
        total += (
            (fmt.sparse_keys * (key_bits is not None) + fmt.sparse_values * (value_bits is not None))
            * (dtype_bytes + 2)
            / BLOCK
        )
    return total / (layers * kv_heads * full)


def counted_ratio(fmt: Format, layers: int, head_dim: int, tokens: int, kv_heads: int = 1) -> float:
    """Bytes per token over full precision's of one sequence of `tokens`, counted as
    `bench.kv_quality` counts the engine's blocks at its last step: whole blocks, the sink blocks,
    the window and the block being written at full precision, every other block at the cold
    format's bytes (keys sharing scales over several blocks counted as cold)."""
    blocks = -(-tokens // BLOCK)
    if not fmt.quantise:
        return blocks * BLOCK / tokens
    cold = max(0, min(blocks, (tokens - fmt.residual) // BLOCK) - fmt.sink_blocks)
    held = cold * bytes_ratio(fmt, layers, head_dim, kv_heads=kv_heads) + (blocks - cold)
    return held * BLOCK / tokens


def _part(bits: int | None, head_dim: int, dtype_bytes: int, scales: float) -> float:
    return head_dim * dtype_bytes if bits is None else code_bytes(bits, head_dim) + scales


def code_bytes(bits: int, head_dim: int) -> float:
    """Bytes of codes per head and token at `bits` (the engine's for 8, 6 and 4; for the widths only
    the search holds, the codes packed tight: head_dim * bits / 8)."""
    if bits in (4, 6, 8):
        return QuantFormat(bits).code_dim(head_dim)
    _levels(bits)
    return head_dim * bits / 8


def part_bytes(bits: int | None, head_dim: int, keys: bool, dtype_bytes: int = 2) -> float:
    """Bytes per token of one KV head's keys (or values) in one layer at `bits` (None: full
    precision): codes and scales, keys' scale and offset shared per channel over a block."""
    scales = 2 * head_dim * dtype_bytes / BLOCK if keys else 2 * dtype_bytes
    return _part(bits, head_dim, dtype_bytes, scales)


def _levels(bits: int) -> int:
    if not 2 <= bits <= 8:
        raise ValueError(f"the search quantises at 2 to 8 bits, got {bits}")
    return (1 << bits) - 1


def uniform_round_trip(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """`x` quantised at `bits` over groups along `dim` and dequantised, as the engine's quantiser
    does it for 8, 6 and 4 bits (each group's min and range over 2^bits - 1 levels, the codes
    rounded in fp32, scale and min held in x's dtype): the widths the engine does not store, for
    the search."""
    levels = _levels(bits)
    work = x.float()
    low = work.amin(dim=dim, keepdim=True)
    scale = (work.amax(dim=dim, keepdim=True) - low) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((work - low) / scale).clamp_(0, levels)
    return (codes * scale.to(x.dtype).float() + low.to(x.dtype).float()).to(x.dtype)


def head_size(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def clipped_round_trip(x: torch.Tensor, bits: int, clips: tuple[float, ...]) -> torch.Tensor:
    """x (..., D) quantised per row (a token's channels, as values are) and dequantised, each row's
    range shrunk about its middle by whichever of `clips` gives the least squared error (codes
    clamp to the range); with clips (1.0,), the engine's min-max quantiser."""
    work, levels = x.float(), (1 << bits) - 1
    low, high = work.amin(-1, keepdim=True), work.amax(-1, keepdim=True)
    middle, half = (low + high) / 2, (high - low) / 2
    best, best_error = work, torch.full_like(middle, float("inf"))
    for ratio in clips:
        start = middle - half * ratio
        scale = 2 * half * ratio / levels
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round((work - start) / scale).clamp_(0, levels)
        out = codes * scale.to(x.dtype).float() + start.to(x.dtype).float()  # stored in the cache's dtype
        error = (out - work).square().sum(-1, keepdim=True)
        better = error < best_error
        best, best_error = torch.where(better, out, best), torch.where(better, error, best_error)
    return best.to(x.dtype)


def unit_range(
    x: torch.Tensor, dim: int, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each group's min and span over `dim` (rounded to `dtype` when given, as a store holds them)
    and x as (x - min) / span in [0, 1], all fp32."""
    work = x.float()
    low, high = work.amin(dim=dim, keepdim=True), work.amax(dim=dim, keepdim=True)
    if dtype is not None:
        low = low.to(dtype).float()
    span = high - low if dtype is None else (high - low).to(dtype).float()
    unit = ((work - low) / torch.where(span > 0, span, torch.ones_like(span))).clamp_(0, 1)
    return low, span, unit


def nearest_level(unit: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """The index of the level (ascending) nearest each entry of `unit`."""
    return torch.bucketize(unit.contiguous(), (levels[1:] + levels[:-1]) / 2)


def codebook_round_trip(x: torch.Tensor, levels: torch.Tensor, dim: int) -> torch.Tensor:
    """x quantised over `dim` (per channel over a block's tokens for keys, -3; per token for values,
    -1) to the nearest of `levels` between each group's min and max, scale and min held in x's
    dtype as the engine holds them, and dequantised."""
    low, span, unit = unit_range(x, dim, x.dtype)
    return (low + levels[nearest_level(unit, levels)] * span).to(x.dtype)


def outliers(x: torch.Tensor, dim: int, count: int) -> torch.Tensor:
    """A mask of `count` elements per KV head of one block x (block, KVH, D), the groups lying along
    `dim` (0: a channel over the block's tokens, as keys are quantised; -1: a token's channels, as
    values are), chosen greedily: each pick is a group's largest or smallest remaining element,
    whichever frees the most squared range of its group; a group keeps at least two elements."""
    y = x.float().permute(1, 2, 0) if dim == 0 else x.float().permute(1, 0, 2)  # (KVH, groups, n)
    heads, groups, n = y.shape
    ordered, order = y.sort(-1)
    top = torch.zeros(heads, groups, 1, dtype=torch.long)  # dropped from the top, from the bottom
    bottom = torch.zeros_like(top)
    for _ in range(count):
        hi, lo = ordered.gather(-1, n - 1 - top), ordered.gather(-1, bottom)
        hi2, lo2 = (
            ordered.gather(-1, (n - 2 - top).clamp(min=0)),
            ordered.gather(-1, (bottom + 1).clamp(max=n - 1)),
        )
        span = (hi - lo).square()
        gains = torch.cat((span - (hi2 - lo).square(), span - (hi - lo2).square()), -1)  # (KVH, groups, 2)
        gains = gains.masked_fill(n - top - bottom <= 2, float("-inf")).flatten(1)
        best = gains.argmax(-1)
        rows, group, side = torch.arange(heads), best // 2, best % 2
        room = gains.amax(-1) > float("-inf")  # a head whose groups can give up nothing more takes none
        top[rows, group, 0] += (side == 0) & room
        bottom[rows, group, 0] += (side == 1) & room
    rank = torch.arange(n)
    kept_sorted = (rank >= n - top) | (rank < bottom)
    kept = torch.zeros_like(kept_sorted).scatter_(-1, order, kept_sorted)
    return kept.permute(2, 0, 1) if dim == 0 else kept.permute(1, 0, 2)


def fake_quantise(
    keys: torch.Tensor, values: torch.Tensor, key_bits: int | None, value_bits: int | None,
    rotation: tuple[torch.Tensor | None, torch.Tensor | None], value_clips: tuple[float, ...] = (),
    levels: tuple[torch.Tensor, torch.Tensor] | None = None, hot: tuple[torch.Tensor, int] | None = None,
    hot_values: torch.Tensor | None = None, sparse: tuple[int, int] = (0, 0), keys_per_token: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One block's keys and values (block, KV heads, head_dim) as the engine's cold store gives
    them back: (rotated,) quantised by `quantize_keys` / `quantize_values`, dequantised (and
    rotated back), in the input's dtype; with `levels` (keys', values'), 4-bit parts through
    those codebooks instead (`codebook_round_trip`); with `hot` (a (KV heads, head_dim) mask, its
    bits), the masked key channels at those bits; with `hot_values` (a mask), those value channels
    kept and the rest quantised per token over themselves; with `sparse` (keys', values' counts),
    that many `outliers` per KV head kept exact and the rest quantised over themselves; with
    `keys_per_token`, keys quantised per token over their (rotated) channels, as values are."""

    def dense_and_sparse(x: torch.Tensor, bits: int, count: int, per_channel: bool) -> torch.Tensor:
        dim = 0 if per_channel else -1
        kept = outliers(x, dim, count)
        # the kept elements take a remaining one's value, so each group's range is the rest's
        filler = x.masked_fill(kept, float("inf")).amin(dim, keepdim=True)
        dense = torch.where(kept, filler.expand_as(x), x)
        return torch.where(kept, x, round_trip(dense, bits, None, per_channel))

    def round_trip(x: torch.Tensor, bits: int, r: torch.Tensor | None, per_channel: bool) -> torch.Tensor:
        if levels is not None and bits == 4 and r is None:
            return codebook_round_trip(x, levels[0] if per_channel else levels[1], -3 if per_channel else -1)
        work = x if r is None else (x.float() @ r).to(x.dtype)
        if bits not in (4, 6, 8):  # a width only the search holds
            out = uniform_round_trip(work, bits, -3 if per_channel else -1).float()
        else:
            qf = QuantFormat(bits)
            codes, scale, low = (quantize_keys if per_channel else quantize_values)(work, qf)
            if per_channel:  # scale (KVH, D) per channel of the block
                scale, low = scale[None], low[None]
            else:  # (block, KVH) per token
                scale, low = scale[..., None], low[..., None]
            out = unpack(codes, qf).float() * scale.float() + low.float()
        return (out if r is None else out @ r).to(x.dtype)

    if key_bits is not None and hot is not None and hot[1] > key_bits:
        if rotation[0] is not None:
            raise ValueError("hot key channels are not rotated here")
        mask, bits = hot
        keys = torch.where(mask, round_trip(keys, bits, None, True), round_trip(keys, key_bits, None, True))
    elif key_bits is not None and sparse[0]:
        keys = dense_and_sparse(keys, key_bits, sparse[0], per_channel=True)
    elif key_bits is not None:
        keys = round_trip(keys, key_bits, rotation[0], per_channel=not keys_per_token)
    if value_bits is not None and value_clips:
        if rotation[1] is not None:
            raise ValueError("clipped values are not rotated here")
        values = clipped_round_trip(values, value_bits, value_clips)
    elif value_bits is not None and hot_values is not None:
        # the hot channels take a cold channel's value, so each token's range is the cold ones'
        filler = values.masked_fill(hot_values, float("inf")).amin(-1, keepdim=True)
        cold = torch.where(hot_values, filler.expand_as(values), values)
        values = torch.where(hot_values, values, round_trip(cold, value_bits, None, per_channel=False))
    elif value_bits is not None and sparse[1]:
        values = dense_and_sparse(values, value_bits, sparse[1], per_channel=False)
    elif value_bits is not None:
        values = round_trip(values, value_bits, rotation[1], per_channel=False)
    return keys, values


def logprobs(
    model: Any, ids: torch.Tensor, prompt_len: int, fmt: Format, codebooks: Codebooks | None = None,
    hot: HotChannels | None = None, hot_values: HotChannels | None = None,
) -> torch.Tensor:  # fmt: skip
    """Log-probabilities (continuation, vocabulary) of the tokens after the prompt, the cache's
    cold blocks fake-quantised as the engine would hold them after every step."""
    from transformers import DynamicCache

    h = hadamard(head_size(model.config))
    rotation = (h if fmt.rotate_keys else None, h if fmt.rotate_values else None)
    rope = rotary_angles(model, len(ids)) if fmt.pre_rope_keys else None
    steps = [(a, min(a + fmt.prompt_chunk, prompt_len)) for a in range(0, prompt_len, fmt.prompt_chunk)]
    steps += [(a, min(a + BLOCK, len(ids))) for a in range(prompt_len, len(ids), BLOCK)]
    cache, rows = DynamicCache(), []
    cold_values = fmt.sink_blocks  # the first block not yet quantised: values, then each layer's keys
    cold_keys = [fmt.sink_blocks] * model.config.num_hidden_layers
    with torch.inference_mode():
        for start, end in steps:
            logits = model(input_ids=ids[None, start:end], cache=cache, use_cache=True).logits[0]
            if end >= prompt_len:
                first = max(start, prompt_len - 1)  # the last prompt token predicts the first output
                rows.append(logits[first - start : end - start].float())
            if not fmt.quantise:
                continue
            limit = (end - fmt.residual) // BLOCK
            held = cast(list[Any], cache.layers)  # full-attention layers: .keys, .values
            for block in range(cold_values, limit):  # values: per token, as each block goes cold
                span = slice(block * BLOCK, (block + 1) * BLOCK)
                _requantise(held, fmt, span, rotation, keys=False, codebooks=codebooks, hot_values=hot_values)
            for layer, cached in enumerate(held):  # keys: once every block sharing their scales is cold
                group = fmt.key_group(layer)
                while cold_keys[layer] + group <= limit:
                    span = slice(cold_keys[layer] * BLOCK, (cold_keys[layer] + group) * BLOCK)
                    _requantise(
                        [cached],
                        fmt,
                        span,
                        rotation,
                        keys=True,
                        first_layer=layer,
                        rope=rope,
                        codebooks=codebooks,
                        hot=hot,
                    )
                    cold_keys[layer] += group
            cold_values = max(cold_values, limit)
    return torch.log_softmax(torch.cat(rows)[: len(ids) - prompt_len], dim=-1)


def rotary_angles(model: Any, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's rotary cos and sin for positions 0..length-1, fp32, (length, head_dim)."""
    positions = torch.arange(length)[None]
    with torch.inference_mode():
        cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    return cos[0].float(), sin[0].float()


def rope_turn(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """Keys (T, KVH, D) turned by rotary embedding's angles at their positions (cos, sin (T, D)),
    in fp32: sign +1 applies the embedding, -1 undoes it (transformers' half-split layout)."""
    x = keys.float()
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + sign * turned * sin[:, None]


def _per_head(
    part: torch.Tensor, fmt: Format, layer: int, rotation: tuple[torch.Tensor | None, torch.Tensor | None],
    keys: bool,
) -> torch.Tensor:  # fmt: skip
    """One layer's keys (or values) of a span (tokens, KV heads, head_dim), each KV head
    fake-quantised at its own bits by the plain quantiser."""
    if fmt.pre_rope_keys or fmt.codebook or fmt.hot_keys or fmt.hot_values or fmt.value_clips:
        raise ValueError("head_bits takes the plain quantiser only")
    if fmt.sparse_keys or fmt.sparse_values:
        raise ValueError("head_bits takes the plain quantiser only")
    heads = []
    for head in range(part.shape[1]):
        key_bits, value_bits = fmt.bits(layer, head)
        one = part[:, head : head + 1]
        quantised = fake_quantise(
            one, one, key_bits if keys else None, None if keys else value_bits, rotation,
            keys_per_token=fmt.keys_per_token_in(layer),
        )  # fmt: skip
        heads.append(quantised[0] if keys else quantised[1])
    return torch.cat(heads, dim=1)


def _requantise(
    held: list[Any], fmt: Format, span: slice, rotation: tuple[torch.Tensor | None, torch.Tensor | None], *,
    keys: bool, first_layer: int = 0, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    codebooks: Codebooks | None = None, hot: HotChannels | None = None,
    hot_values: HotChannels | None = None,
) -> None:  # fmt: skip
    """The keys (or the values) of `span` in the layers `held` (the first is `first_layer`),
    fake-quantised in place at each layer's bits; with `rope`, keys before rotary embedding; with
    `fmt.codebook`, 4-bit parts through the layer's `codebooks`; with `fmt.hot_keys`, the layer's
    `hot` key channels at `fmt.hot_key_bits`."""
    for layer, cached in enumerate(held, start=first_layer):
        key_bits, value_bits = fmt.bits(layer)
        levels = codebooks[layer] if fmt.codebook and codebooks is not None else None
        mask = (hot[layer], fmt.hot_key_bits) if fmt.hot_keys and hot is not None else None
        kept = hot_values[layer] if fmt.hot_values and hot_values is not None else None
        tensor = cached.keys if keys else cached.values
        part = tensor[0, :, span].transpose(0, 1)
        if fmt.heads_of(layer):
            part = _per_head(part, fmt, layer, rotation, keys)
        elif keys and rope is not None and key_bits is not None:
            cos, sin = rope[0][span], rope[1][span]
            plain = rope_turn(part, cos, sin, -1.0)
            quantised, _ = fake_quantise(plain, plain, key_bits, None, rotation, levels=levels)
            part = rope_turn(quantised, cos, sin, 1.0).to(part.dtype)
        elif keys:
            part, _ = fake_quantise(
                part, part, key_bits, None, rotation, levels=levels, hot=mask, sparse=(fmt.sparse_keys, 0),
                keys_per_token=fmt.keys_per_token_in(layer),
            )  # fmt: skip
        else:
            _, part = fake_quantise(
                part, part, None, value_bits, rotation, fmt.value_clips, levels, hot_values=kept,
                sparse=(0, fmt.sparse_values),
            )  # fmt: skip
        tensor[0, :, span] = part.transpose(0, 1)
