"""Which quantised KV format to build next: formats tried by fake quantisation, KL only, in minutes.

`bench.kv_quality` measures a profile the engine runs, with analyses, on the whole corpus: hours on
this CPU. This program answers a narrower question fast: how much does a candidate format disturb
the model's next-token distributions? On evenly spaced documents of bench/data/kv-corpus.jsonl the
model (transformers, bf16 unless --dtype says otherwise) reads the narrative prompt in 192-token
chunks and then teacher-forces its own greedy continuation (--tf-tokens) in 16-token steps; after
every step the blocks the engine would have moved to cold storage (whole 16-token blocks past the sink blocks, older than the
residual window) are quantised and dequantised in place, once each, with the engine's own
`quantize_keys` / `quantize_values` (keys per channel over a block, values per token). Every
format's logits are compared with the same run unquantised: mean next-token KL over the whole
vocabulary and top-1 agreement. `floor` reads the prompt in 128-token chunks instead, unquantised:
what rounding alone gives, the bar's reference.

A format sets bits for keys and values (8, 4, or none: full precision) per layer, optional
Hadamard rotation of keys and/or values before quantising, the residual window, the sink blocks,
and optionally a value range chosen by least squared error instead of min-max (`value_clips`: not
yet a quantiser the engine has; the same bytes), or keys quantised before rotary embedding
(`pre_rope_keys`: turned back by the model's rotary angles first; not yet a store the engine has,
the same bytes), or 4-bit codes indexing 16 levels fitted per layer to this model's keys and values
(`codebook`: Lloyd-Max on `--calibration-docs` corpus documents the evaluation does not use, a
group's min and max kept exact; not yet a store the engine has, the same bytes), or, per KV head,
the key channels that carry most of the scores' expected error at 8 bits (`hot_keys`: a channel's
mean squared query times its mean squared range over a block, on the same calibration documents;
keys are quantised per channel, so a channel's bits are its own) and the value channels that weigh
most in the output kept at full precision, the rest quantised per token over their own range
(`hot_values`; neither is a store the engine has yet, both cost bytes, counted). Bytes per token
are given twice: the cold blocks' exact bytes (codes, scales, offsets) over bf16's, and "counted"
as `bench.kv_quality` counts a sequence's blocks at its last step (the sink blocks, the window and
the block being written at full precision; median over the documents, prompt and continuation).
No engine kernel is exercised: a format found here is built, then measured by `bench.kv_quality`.

    python -m bench.kv_formats --docs 12 --out bench/results/kv-formats-cpu.json
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch
from rich.console import Console
from rich.table import Table

from bench import common
from engine.kv_quant import QuantFormat, hadamard, quantize_keys, quantize_values, unpack
from engine.loader import select_dtype

CORPUS = Path(__file__).with_name("data") / "kv-corpus.jsonl"
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

    def bits(self, layer: int) -> tuple[int | None, int | None]:
        return self.layer_bits.get(layer, (self.key_bits, self.value_bits))

    def key_group(self, layer: int) -> int:
        return self.layer_key_blocks.get(layer, self.key_blocks)

    def hot_key_choice(self) -> str:
        """Names the choice of hot key channels (count, pooled or not) that this format reads."""
        return f"{self.hot_keys}{' pooled' if self.hot_keys_pooled else ''}"


CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)

# The most sensitive layers of the 0.5B default (one layer quantised to int4 at a time, 6 documents:
# 16, 11, 9, 13, 21 raise KL most; the rest sit at the floor).
SENSITIVE = (9, 11, 13, 16, 21)

# int4, but int8 in the sensitive layers: the engine's KV_QUANT_BITS=4 KV_INT8_LAYERS=9,11,13,16,21
MIXED = Format(layer_bits={layer: (8, 8) for layer in SENSITIVE})

FORMATS: dict[str, Format] = {
    "floor": Format(quantise=False, prompt_chunk=128),
    "int8": Format(key_bits=8, value_bits=8),
    "int4": Format(),
    "int4-rot": Format(rotate_keys=True, rotate_values=True),
    "int4-rot-values": Format(rotate_values=True),
    "k4-only": Format(value_bits=None),
    "v4-only": Format(key_bits=None),
    "k8v4": Format(key_bits=8),
    "int4-window64": Format(residual=64),
    "int4+int8@3layers": Format(layer_bits={layer: (8, 8) for layer in (9, 11, 16)}),
    "int4+int8@5layers": MIXED,
    "int4+k8@5layers": Format(layer_bits={layer: (8, 4) for layer in SENSITIVE}),
    "int4+k8@5layers+v8@2": Format(
        layer_bits={layer: (8, 8) if layer in (11, 16) else (8, 4) for layer in SENSITIVE}
    ),
    # Key scales over 32 or 64 tokens instead of 16: a fifth of int4's key bytes are scales.
    "int4-keys32": Format(key_blocks=2),
    "int4-keys64": Format(key_blocks=4),
    "int4+int8@5layers-keys32": replace(MIXED, key_blocks=2),
    "int4+k8@5layers+v8@2-keys32": Format(
        layer_bits={layer: (8, 8) if layer in (11, 16) else (8, 4) for layer in SENSITIVE}, key_blocks=2
    ),
    # 32-token key scales only where int4 costs little; the sensitive layers int8 with 16-token ones.
    "int4-keys32+int8@5layers": replace(MIXED, key_blocks=2, layer_key_blocks=dict.fromkeys(SENSITIVE, 1)),
    # What the engine holds at full precision besides cold blocks: the sink block, the window, the
    # block being written (~0.04 of the bytes at ~1,000-token documents). Shorter windows, no sink.
    "int4+int8@5layers-w16": replace(MIXED, residual=16),
    "int4+int8@5layers-w0": replace(MIXED, residual=0),
    "int4+int8@5layers-nosink": replace(MIXED, sink_blocks=0),
    "int4+int8@5layers-w0-nosink": replace(MIXED, residual=0, sink_blocks=0),
    "int4-w0-nosink": Format(residual=0, sink_blocks=0),
    # A better quantiser at the same bytes: the value range chosen by least squared error.
    "int4+int8@5layers-w0-vclip": replace(MIXED, residual=0, value_clips=CLIPS),
    "int4+int8@5layers-w0-nosink-vclip": replace(MIXED, residual=0, sink_blocks=0, value_clips=CLIPS),
    # Keys quantised before rotary embedding: a key channel pair turns with position after it, which
    # widens each channel's range over a block; before it, a channel's outliers stay in that channel.
    "int4-prerope": Format(pre_rope_keys=True),
    "int4+int8@5layers-w0-prerope": replace(MIXED, residual=0, pre_rope_keys=True),
    "int4+int8@5layers-w0-nosink-prerope": replace(MIXED, residual=0, sink_blocks=0, pre_rope_keys=True),
    # Non-uniform 4-bit levels (KVQuant's nuq idea), fitted per layer: int4 alone, and the profile.
    "int4-codebook": Format(codebook=True),
    "int4+int8@5layers-w0-codebook": replace(MIXED, residual=0, codebook=True),
    # The keys' bits where the query looks: 8 or 16 channels of 64 per KV head at 8 bits, chosen per
    # layer by query energy x range (calibration documents), the rest at 4; values 4 bits, or 8 in
    # the sensitive layers.
    "int4-hot8": Format(hot_keys=8),
    "int4-hot16": Format(hot_keys=16),
    "int4-hot8-w0": Format(hot_keys=8, residual=0),
    "int4-hot16-w0": Format(hot_keys=16, residual=0),
    "int4-hot8+v8@5layers-w0": Format(
        hot_keys=8, residual=0, layer_bits={layer: (4, 8) for layer in SENSITIVE}
    ),
    "int4-hot12+v8@5layers-w0": Format(
        hot_keys=12, residual=0, layer_bits={layer: (4, 8) for layer in SENSITIVE}
    ),
    "int4-hot16+v8@4layers-w0": Format(
        hot_keys=16, residual=0, layer_bits={layer: (4, 8) for layer in SENSITIVE[1:]}
    ),
    "int4+int8@5layers-w0-hot8": replace(MIXED, residual=0, hot_keys=8),
    "int4-hot16pooled-w0": Format(hot_keys=16, hot_keys_pooled=True, residual=0),
    "int4-hot16pooled-v2-w0": Format(hot_keys=16, hot_keys_pooled=True, hot_values=2, residual=0),
    "int4-hot16-v2-w0": Format(hot_keys=16, hot_values=2, residual=0),
    "int4-hot16-v4-w0": Format(hot_keys=16, hot_values=4, residual=0),
    "int4-v4-w0": Format(hot_values=4, residual=0),
    "int4-hot16+v8@2layers-v2-w0": Format(
        hot_keys=16, hot_values=2, residual=0, layer_bits={layer: (4, 8) for layer in (11, 16)}
    ),
}

# Levels of a 4-bit codebook, per layer: (keys', values'), each (16,) ascending in [0, 1] (0 and 1
# included: a group's min and max), a code picking the level nearest (x - min) / (max - min).
Codebooks = dict[int, tuple[torch.Tensor, torch.Tensor]]

# Per layer, (KV heads, head_dim) bool: the key channels a `hot_keys` format holds at its hot bits.
HotChannels = dict[int, torch.Tensor]


def bytes_ratio(fmt: Format, layers: int, head_dim: int, dtype_bytes: int = 2) -> float:
    """Cold bytes per token over full precision's, all layers (per KV head: the same for each)."""
    if not fmt.quantise:
        return 1.0
    full = 2 * head_dim * dtype_bytes  # one token's key and value
    total = 0.0
    for layer in range(layers):
        key_bits, value_bits = fmt.bits(layer)
        # keys: a scale and an offset per channel and `key_group` blocks; values: per token
        key_scales = 2 * head_dim * dtype_bytes / (BLOCK * fmt.key_group(layer))
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
    return total / (layers * full)


def counted_ratio(fmt: Format, layers: int, head_dim: int, tokens: int) -> float:
    """Bytes per token over full precision's of one sequence of `tokens`, counted as
    `bench.kv_quality` counts the engine's blocks at its last step: whole blocks, the sink blocks,
    the window and the block being written at full precision, every other block at the cold
    format's bytes (keys sharing scales over several blocks counted as cold)."""
    blocks = -(-tokens // BLOCK)
    if not fmt.quantise:
        return blocks * BLOCK / tokens
    cold = max(0, min(blocks, (tokens - fmt.residual) // BLOCK) - fmt.sink_blocks)
    held = cold * bytes_ratio(fmt, layers, head_dim) + (blocks - cold)
    return held * BLOCK / tokens


def _part(bits: int | None, head_dim: int, dtype_bytes: int, scales: float) -> float:
    return head_dim * dtype_bytes if bits is None else QuantFormat(bits).code_dim(head_dim) + scales


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


def lloyd_levels(samples: torch.Tensor, count: int = 16, rounds: int = 50) -> torch.Tensor:
    """`count` levels in [0, 1], 0 and 1 kept, the inner ones moved by Lloyd-Max iterations to the
    means of the samples nearest each (least squared error for these samples), from even spacing."""
    levels = torch.linspace(0, 1, count, dtype=torch.float64)
    data = samples.double().flatten()
    for _ in range(rounds):
        nearest = nearest_level(data, levels)
        sums = torch.zeros(count, dtype=torch.float64).index_add_(0, nearest, data)
        counts = torch.bincount(nearest, minlength=count).double()
        inner = torch.where(counts[1:-1] > 0, sums[1:-1] / counts[1:-1].clamp(min=1), levels[1:-1])
        levels = torch.cat((levels[:1], inner, levels[-1:]))
    return levels.float()


def calibrate(model: Any, seqs: list[tuple[torch.Tensor, int]]) -> Codebooks:
    """Each layer's 4-bit key and value levels, fitted to the groups the cold store quantises in
    these sequences' prompts: keys per channel over 16-token blocks, values per token."""
    keys: dict[int, list[torch.Tensor]] = {}
    values: dict[int, list[torch.Tensor]] = {}
    for layer, held, blocks in prompt_caches(model, seqs):
        k = held.keys[0, :, : blocks * BLOCK]  # (KVH, T, D)
        keys.setdefault(layer, []).append(_inner(k.reshape(k.shape[0], blocks, BLOCK, -1), 2))
        values.setdefault(layer, []).append(_inner(held.values[0], -1))
    return {
        layer: (lloyd_levels(torch.cat(keys[layer])), lloyd_levels(torch.cat(values[layer])))
        for layer in keys
    }


def round_trip_errors(
    model: Any, seqs: list[tuple[torch.Tensor, int]], codebooks: Codebooks
) -> dict[str, float]:
    """Squared error of the 4-bit round trip, summed over every block of these sequences' prompts
    and every layer, per part (keys, values) and grid (`uniform`: the engine's, `codebook`): what
    the fitted levels change in the quantiser's own error, before the model sees it."""
    errors: dict[str, float] = {}
    for layer, held, blocks in prompt_caches(model, seqs):
        for part, tensor in (("keys", held.keys), ("values", held.values)):
            x = tensor[0, :, : blocks * BLOCK].transpose(0, 1)  # (T, KVH, D)
            grouped = x.reshape(blocks, BLOCK, *x.shape[1:])
            for grid in ("uniform", "codebook"):
                levels = codebooks[layer] if grid == "codebook" else None
                out = torch.stack([
                    fake_quantise(b, b, 4, None, (None, None), levels=levels)[0] if part == "keys"
                    else fake_quantise(b, b, None, 4, (None, None), levels=levels)[1]
                    for b in grouped
                ])  # fmt: skip
                key = f"{part} {grid}"
                errors[key] = errors.get(key, 0.0) + float((out.float() - grouped.float()).square().sum())
    return errors


def channel_weights(
    model: Any, seqs: list[tuple[torch.Tensor, int]]
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Per layer, (KV heads, head_dim), over these sequences' prompts in one pass each:

    - keys: what a unit of quantisation error in each key channel costs the attention scores: the
      channel's mean squared query (after rotary embedding, over the query heads that read that KV
      head) times its mean squared range over a 16-token block (a uniform quantiser's error
      variance is proportional to it);
    - values: how much each value channel weighs in the attention's output: its mean squared value
      times the squared norm of the output projection's columns that read it."""
    config = model.config
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, head_size(config)
    queries: dict[int, torch.Tensor] = {}
    hooks = [
        layer.self_attn.q_proj.register_forward_hook(
            lambda _m, _i, out, at=index: queries.__setitem__(at, out.detach())
        )
        for index, layer in enumerate(model.model.layers)
    ]
    query_energy: dict[int, torch.Tensor] = {}
    ranges: dict[int, torch.Tensor] = {}
    value_energy: dict[int, torch.Tensor] = {}
    tokens = blocks_seen = 0
    try:
        for layer, held, blocks in prompt_caches(model, seqs):
            length = held.keys.shape[2]
            cos, sin = rotary_angles(model, length)
            q = rope_turn(queries[layer][0].view(length, heads, head_dim), cos, sin, 1.0)
            grouped = q.square().view(length, kv_heads, heads // kv_heads, head_dim).mean(2).sum(0)
            k = held.keys[0, :, : blocks * BLOCK].transpose(0, 1).float()
            k = k.reshape(blocks, BLOCK, kv_heads, head_dim)
            spans = (k.amax(1) - k.amin(1)).square().sum(0)
            query_energy[layer] = query_energy.get(layer, 0) + grouped
            ranges[layer] = ranges.get(layer, 0) + spans
            value_energy[layer] = value_energy.get(layer, 0) + held.values[0].float().square().sum(1)
            if layer == 0:
                tokens, blocks_seen = tokens + length, blocks_seen + blocks
    finally:
        for hook in hooks:
            hook.remove()
    keys, values = {}, {}
    for layer in query_energy:
        keys[layer] = (query_energy[layer] / tokens) * (ranges[layer] / blocks_seen)
        columns = model.model.layers[layer].self_attn.o_proj.weight.detach().float().square().sum(0)
        reads = columns.view(kv_heads, heads // kv_heads, head_dim).sum(1)  # (H * D,) -> (KVH, D)
        values[layer] = value_energy[layer] / tokens * reads
    return keys, values


@dataclass
class Channels:
    """The channels the hot formats single out, chosen on calibration prompts."""

    keys: dict[str, HotChannels]  # by `Format.hot_key_choice`
    values: dict[int, HotChannels]  # by `Format.hot_values`
    key_shares: dict[
        str, dict[int, list[float]]
    ]  # per key choice, layer and KV head: its share of the weight


def choose_channels(model: Any, prompts: list[tuple[torch.Tensor, int]], formats: list[Format]) -> Channels:
    """The hot key and value channels every one of `formats` reads, weighed on `prompts`."""
    key_choices = {f.hot_key_choice(): (f.hot_keys, f.hot_keys_pooled) for f in formats if f.hot_keys}
    value_counts = {f.hot_values for f in formats if f.hot_values}
    if not key_choices and not value_counts:
        return Channels({}, {}, {})
    key_weights, value_weights = channel_weights(model, prompts)
    keys = {name: hot_channels(key_weights, *choice) for name, choice in sorted(key_choices.items())}
    shares = {
        name: {
            layer: ((key_weights[layer] * mask).sum(-1) / key_weights[layer].sum(-1)).tolist()
            for layer, mask in masks.items()
        }
        for name, masks in keys.items()
    }
    return Channels(
        keys, {count: hot_channels(value_weights, count) for count in sorted(value_counts)}, shares
    )


def hot_channels(weights: dict[int, torch.Tensor], count: int, pooled: bool = False) -> HotChannels:
    """Per layer, the `count` channels of each KV head with the largest weights, as a bool mask;
    `pooled`: count x heads x layers channels with the largest weights wherever they are."""
    if pooled:
        stacked = torch.stack([weights[layer] for layer in sorted(weights)])  # (L, KVH, D)
        mask = torch.zeros(stacked.numel(), dtype=torch.bool)
        mask[stacked.flatten().topk(count * stacked.shape[0] * stacked.shape[1]).indices] = True
        return {layer: m for layer, m in zip(sorted(weights), mask.view_as(stacked), strict=True)}
    out = {}
    for layer, w in weights.items():
        mask = torch.zeros_like(w, dtype=torch.bool)
        mask.scatter_(-1, w.topk(count, dim=-1).indices, True)
        out[layer] = mask
    return out


def prompt_caches(model: Any, seqs: list[tuple[torch.Tensor, int]]) -> Iterator[tuple[int, Any, int]]:
    """For each sequence's prompt read in one forward, each layer's cache as (layer, its
    `DynamicCache` layer with .keys and .values (1, KVH, T, D), whole 16-token blocks in the prompt)."""
    from transformers import DynamicCache

    with torch.inference_mode():
        for ids, prompt_len in seqs:
            cache = DynamicCache()
            model(input_ids=ids[None, :prompt_len], cache=cache, use_cache=True)
            for layer, held in enumerate(cast(list[Any], cache.layers)):
                yield layer, held, prompt_len // BLOCK


def _inner(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x's entries as (x - min) / (max - min) over `dim`, without each group's min and max."""
    _, _, unit = unit_range(x, dim)
    return unit[(unit > 0) & (unit < 1)]


def fake_quantise(
    keys: torch.Tensor, values: torch.Tensor, key_bits: int | None, value_bits: int | None,
    rotation: tuple[torch.Tensor | None, torch.Tensor | None], value_clips: tuple[float, ...] = (),
    levels: tuple[torch.Tensor, torch.Tensor] | None = None, hot: tuple[torch.Tensor, int] | None = None,
    hot_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One block's keys and values (block, KV heads, head_dim) as the engine's cold store gives
    them back: (rotated,) quantised by `quantize_keys` / `quantize_values`, dequantised (and
    rotated back), in the input's dtype; with `levels` (keys', values'), 4-bit parts through
    those codebooks instead (`codebook_round_trip`); with `hot` (a (KV heads, head_dim) mask, its
    bits), the masked key channels at those bits; with `hot_values` (a mask), those value channels
    kept and the rest quantised per token over themselves."""

    def round_trip(x: torch.Tensor, bits: int, r: torch.Tensor | None, per_channel: bool) -> torch.Tensor:
        if levels is not None and bits == 4 and r is None:
            return codebook_round_trip(x, levels[0] if per_channel else levels[1], -3 if per_channel else -1)
        work = x if r is None else (x.float() @ r).to(x.dtype)
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
    elif key_bits is not None:
        keys = round_trip(keys, key_bits, rotation[0], per_channel=True)
    if value_bits is not None and value_clips:
        if rotation[1] is not None:
            raise ValueError("clipped values are not rotated here")
        values = clipped_round_trip(values, value_bits, value_clips)
    elif value_bits is not None and hot_values is not None:
        # the hot channels take a cold channel's value, so each token's range is the cold ones'
        filler = values.masked_fill(hot_values, float("inf")).amin(-1, keepdim=True)
        cold = torch.where(hot_values, filler.expand_as(values), values)
        values = torch.where(hot_values, values, round_trip(cold, value_bits, None, per_channel=False))
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
        if keys and rope is not None and key_bits is not None:
            cos, sin = rope[0][span], rope[1][span]
            plain = rope_turn(part, cos, sin, -1.0)
            quantised, _ = fake_quantise(plain, plain, key_bits, None, rotation, levels=levels)
            part = rope_turn(quantised, cos, sin, 1.0).to(part.dtype)
        elif keys:
            part, _ = fake_quantise(part, part, key_bits, None, rotation, levels=levels, hot=mask)
        else:
            _, part = fake_quantise(
                part, part, None, value_bits, rotation, fmt.value_clips, levels, hot_values=kept
            )
        tensor[0, :, span] = part.transpose(0, 1)


@dataclass
class Result:
    format: str
    bytes_ratio: float
    counted_ratio: float  # median over the documents: sink, window and the block being written too
    kl_mean: float
    kl_per_doc: list[float]
    top1: float
    seconds: float
    spec: dict[str, Any]


def prompt_ids(tokenizer: Any, doc: dict[str, Any]) -> torch.Tensor:
    """The document's narrative prompt, as the engine would read it."""
    from prompts import render
    from schemas import BUILT_IN_KINDS, Language, Polarity

    polarity = Polarity(doc.get("label_polarity", "neutral"))
    messages = render(BUILT_IN_KINDS[doc["kind"]], Language(doc["language"]), doc["text"], polarity).messages
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])


def continuations(
    model: Any, tokenizer: Any, docs: list[dict[str, Any]], tokens: int
) -> list[tuple[torch.Tensor, int]]:
    """Each document's narrative prompt followed by the model's greedy continuation."""
    out = []
    for doc in docs:
        prompt = prompt_ids(tokenizer, doc)
        with torch.inference_mode():
            ids = model.generate(prompt[None], max_new_tokens=tokens, do_sample=False)[0]
        out.append((ids, len(prompt)))
    return out


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated names of FORMATS")
    parser.add_argument("--docs", type=int, default=12, help="evenly spaced documents of the corpus")
    parser.add_argument("--tf-tokens", type=int, default=128)
    parser.add_argument(
        "--calibration-docs", type=int, default=6,
        help="corpus documents (none of the evaluated ones) the codebook formats' levels are fitted on",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench/results/kv-formats.json"))
    parser.add_argument(
        "--dtype", choices=("auto", "bfloat16", "float32"), default="bfloat16",
        help="the model's and the cache's; auto: the engine's choice (fp32 on a CPU without native bf16, "
        "where bf16 products are several times slower)",
    )  # fmt: skip
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.kv_quality import load_corpus

    console = Console(width=140)
    args.model = common.model_path(args.model)
    names = common.names(parser, args.formats, FORMATS)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    args.dtype = str(select_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")
    model: Any = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
    )
    model.eval()
    docs = load_corpus(args.docs)
    seqs = continuations(model, tokenizer, docs, args.tf_tokens)
    reference = [logprobs(model, ids, n, Format(quantise=False)) for ids, n in seqs]
    fitted = calibration_documents(docs, args.calibration_docs)
    calibration = [(p, len(p)) for p in (prompt_ids(tokenizer, d) for d in fitted)]
    formats = [FORMATS[name] for name in names]
    if any(f.codebook or f.hot_keys or f.hot_values for f in formats):
        console.print(f"calibration documents: {[d['document_id'] for d in fitted]}")
    codebooks, errors = None, None
    if any(f.codebook for f in formats):
        codebooks = calibrate(model, calibration)
        errors = round_trip_errors(model, seqs, codebooks)
        console.print("4-bit round trip, squared error on the evaluated prompts, codebook / uniform: " + ", ".join(
            f"{part} {errors[f'{part} codebook'] / errors[f'{part} uniform']:.3f}" for part in ("keys", "values")))  # fmt: skip
    channels = choose_channels(model, calibration, formats)
    for choice, per_layer in channels.key_shares.items():
        flat = [share for heads in per_layer.values() for share in heads]
        console.print(
            f"{choice} hot key channels carry {min(flat):.2f}-{max(flat):.2f} of a head's key weight"
        )
    layers = model.config.num_hidden_layers
    head_dim = head_size(model.config)
    results = []
    for name in names:
        fmt, began = FORMATS[name], time.perf_counter()
        kls, top1 = [], []
        for (ids, n), ref in zip(seqs, reference, strict=True):
            test = logprobs(
                model, ids, n, fmt, codebooks, channels.keys.get(fmt.hot_key_choice()), channels.values.get(fmt.hot_values)
            )  # fmt: skip
            kls.append(float((ref.exp() * (ref - test)).sum(-1).mean()))
            top1.append(float((ref.argmax(-1) == test.argmax(-1)).float().mean()))
        counted = statistics.median(counted_ratio(fmt, layers, head_dim, len(ids)) for ids, _ in seqs)
        results.append(Result(name, bytes_ratio(fmt, layers, head_dim), counted, statistics.mean(kls), kls,
                              statistics.mean(top1), time.perf_counter() - began, asdict(fmt)))  # fmt: skip
        console.print(f"{name}: KL {results[-1].kl_mean:.5f}, bytes {results[-1].bytes_ratio:.3f} cold, "
                      f"{counted:.3f} counted")  # fmt: skip
        write(args, docs, results, codebooks, errors, channels)
    table = Table("format", "cold bytes/token vs bf16", "counted", "KL mean", "top-1", "s",
                  title=f"KV formats by fake quantisation, {len(docs)} documents x {args.tf_tokens} tokens")  # fmt: skip
    for r in results:
        table.add_row(
            r.format,
            f"{r.bytes_ratio:.3f}",
            f"{r.counted_ratio:.3f}",
            f"{r.kl_mean:.5f}",
            f"{r.top1:.4f}",
            f"{r.seconds:.0f}",
        )
    console.print(table)
    console.print(f"wrote {args.out}")


def calibration_documents(evaluated: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """`n` evenly spaced corpus documents that are not among those evaluated."""
    from bench.kv_quality import load_corpus

    taken = {d["document_id"] for d in evaluated}
    rest = [d for d in load_corpus(None) if d["document_id"] not in taken]
    return [rest[(2 * i + 1) * len(rest) // (2 * n)] for i in range(n)]


def write(
    args: Any, docs: list[dict[str, Any]], results: list[Result], codebooks: Codebooks | None = None,
    errors: dict[str, float] | None = None, channels: Channels | None = None,
) -> None:  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": {"threads": torch.get_num_threads(), "platform": platform.platform(), "torch": torch.__version__},
        "config": vars(args) | {"model": str(args.model), "out": str(args.out)},
        "documents": [d["document_id"] for d in docs],
        "results": [asdict(r) for r in results],
        "codebooks": {layer: {"keys": k.tolist(), "values": v.tolist()} for layer, (k, v) in (codebooks or {}).items()},
        "round_trip_errors": errors,
        "hot_key_channels": _channel_lists(channels.keys if channels else None),
        "hot_value_channels": _channel_lists(channels.values if channels else None),
        "hot_key_weight_shares": channels.key_shares if channels else None,
    }, indent=1, ensure_ascii=False, default=str))  # fmt: skip


def _channel_lists(chosen: dict[Any, HotChannels] | None) -> dict[Any, dict[int, list[list[int]]]]:
    """count -> layer -> each KV head's chosen channels."""
    return {
        count: {layer: [row.nonzero().flatten().tolist() for row in mask] for layer, mask in masks.items()}
        for count, masks in (chosen or {}).items()
    }


if __name__ == "__main__":
    main()
