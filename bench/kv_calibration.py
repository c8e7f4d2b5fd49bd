"""What the fitted formats of `bench.kv_formats` are fitted on: calibration prompts' caches.

4-bit codebooks (`calibrate`: Lloyd-Max levels per layer for keys and values), the round trip's
squared error under either grid (`round_trip_errors`), and the hot key and value channels
(`channel_weights`, `choose_channels`): all from corpus documents the evaluation does not use
(`calibration_documents`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch

from bench.kv_fake import (
    BLOCK,
    Codebooks,
    Format,
    HotChannels,
    fake_quantise,
    head_size,
    nearest_level,
    rope_turn,
    rotary_angles,
    unit_range,
)


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


def calibration_documents(evaluated: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """`n` evenly spaced corpus documents that are not among those evaluated."""
    from bench.kv_quality import load_corpus

    taken = {d["document_id"] for d in evaluated}
    rest = [d for d in load_corpus(None) if d["document_id"] not in taken]
    return [rest[(2 * i + 1) * len(rest) // (2 * n)] for i in range(n)]
