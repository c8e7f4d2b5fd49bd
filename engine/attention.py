"""The attention function every layer calls during an engine step, over the paged KV cache.

Registered once with `transformers.AttentionInterface` under `ATTENTION_NAME`; the model is loaded
with that implementation and each step passes its `StepBatch` as a forward keyword, which reaches
this function unfiltered. The model's own modules compute projections and RoPE; this function
stores the new (rotated) keys and values, then attends each sequence's queries to its history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.kv_cache import KVCache, head_major_rows

ATTENTION_NAME = "deepanalyze_paged"


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's part of the packed step: its queries and the keys it may attend to."""

    q_start: int  # offset of its first new token in the packed input
    q_len: int  # new tokens this step (a prefill chunk, or 1 for decode)
    kv_slots: torch.Tensor  # (n,) full-precision cache slots of its tokens, history + new, in order
    cold_blocks: torch.Tensor | None = None  # (m,) its quantised blocks (store ids), all history
    cold_tokens: int = 0  # m * block_size
    observe: int = 0  # score the keys by the attention of the chunk's last `observe` queries

    @property
    def hot_len(self) -> int:
        return int(self.kv_slots.shape[0])

    @property
    def kv_len(self) -> int:
        return self.hot_len + self.cold_tokens


@dataclass(frozen=True)
class DecodeGroup:
    """Single-token sequences of similar history length, attended in one padded call."""

    rows: torch.Tensor  # (B,) their rows in the packed input
    head_rows: torch.Tensor  # (B * KVH * Lmax,) rows of a layer's cache viewed as (slots * KVH, D)
    padding: torch.Tensor | None  # (B, 1, 1, Mmax*bs + Lmax) True where a key is padding, or None
    max_len: int  # Lmax: full-precision slots per row
    cold_rows: torch.Tensor | None = None  # (B * KVH * Mmax,) rows of (cold block, KV head), padded
    max_cold: int = 0  # Mmax


@dataclass(frozen=True)
class InPlaceDecodes:
    """Single-token sequences attended where their history lies, by the native kernel
    (`KVCache.kernel`): no gather, no padding, any lengths together. Their quantised blocks too,
    when `cold_blocks` is given (read in the store's format, never dequantised into a copy)."""

    rows: torch.Tensor  # (B,) their rows in the packed input
    slots: torch.Tensor  # their full-precision slots, one sequence after another
    starts: torch.Tensor  # (B + 1,) where each sequence's slots begin, and the total
    cold_blocks: torch.Tensor | None = None  # their quantised blocks (store ids), one after another
    cold_starts: torch.Tensor | None = None  # (B + 1,) where each sequence's blocks begin


@dataclass(frozen=True)
class StepBatch:
    cache: KVCache
    new_slots: torch.Tensor  # (T,) where each packed token's key/value is stored
    seqs: list[SeqSlice]  # chunks of more than one token, attended one by one
    decodes: tuple[DecodeGroup, ...] = ()
    scores: dict[int, torch.Tensor] | None = None  # q_start -> (kv_len,) attention received, summed
    in_place: InPlaceDecodes | None = None


def group_decodes(
    decodes: list[SeqSlice], kv_heads: int, block_size: int, device: torch.device, spread: float = 1.5
) -> tuple[DecodeGroup, ...]:
    """Length buckets for decoding: sorted by history, a new group whenever the longest would
    exceed `spread` times the shortest, so padding wastes at most that share of the reads."""
    groups: list[list[SeqSlice]] = []
    for d in sorted(decodes, key=lambda d: d.kv_len):
        if groups and d.kv_len <= spread * groups[-1][0].kv_len:
            groups[-1].append(d)
        else:
            groups.append([d])
    return tuple(_decode_group(g, kv_heads, block_size, device) for g in groups)


def in_place_decodes(
    decodes: list[SeqSlice], cold: bool = False
) -> tuple[InPlaceDecodes | None, list[SeqSlice]]:
    """The decodes the native kernel attends in place, and the rest, for `group_decodes`: with
    `cold` (the kernel reads the quantised store), all; else those without quantised history."""
    hot = [d for d in decodes if cold or not d.cold_tokens]
    rest = [d for d in decodes if not cold and d.cold_tokens]
    if not hot:
        return None, rest
    lengths = torch.tensor([0] + [d.hot_len for d in hot], dtype=torch.long)
    rows = torch.tensor([d.q_start for d in hot], dtype=torch.long)
    blocks = starts = None
    if cold:
        held = [d.cold_blocks if d.cold_blocks is not None else torch.zeros(0, dtype=torch.long) for d in hot]
        blocks = torch.cat(held)
        starts = torch.tensor([0] + [h.shape[0] for h in held], dtype=torch.long).cumsum(0)
    return InPlaceDecodes(rows, torch.cat([d.kv_slots for d in hot]), lengths.cumsum(0), blocks, starts), rest


def _decode_group(decodes: list[SeqSlice], kv_heads: int, block: int, device: torch.device) -> DecodeGroup:
    longest = max(d.hot_len for d in decodes)
    cold = max(d.cold_tokens for d in decodes) // block
    slots = torch.zeros(len(decodes), longest, dtype=torch.long)  # padding reads slot 0
    blocks = torch.zeros(len(decodes), cold, dtype=torch.long)  # and cold block 0
    padding = torch.ones(len(decodes), 1, 1, cold * block + longest, dtype=torch.bool)
    for i, d in enumerate(decodes):
        slots[i, : d.hot_len] = d.kv_slots
        padding[i, 0, 0, cold * block : cold * block + d.hot_len] = False
        if d.cold_blocks is not None:
            blocks[i, : d.cold_blocks.shape[0]] = d.cold_blocks
            padding[i, 0, 0, : d.cold_tokens] = False
    # Row of (slot, head) in the cache viewed as (slots * KVH, D), ordered (B, KVH, Lmax): one gather
    # gives each (sequence, KV head) its history contiguously, as the batched matmuls want it.
    head_rows = head_major_rows(slots, kv_heads).to(device)
    # Likewise for quantised blocks, a row holding one KV head's tokens of one block.
    cold_rows = head_major_rows(blocks, kv_heads).to(device) if cold else None
    rows = torch.tensor([d.q_start for d in decodes], dtype=torch.long, device=device)
    return DecodeGroup(
        rows, head_rows, padding.to(device) if bool(padding.any()) else None, longest, cold_rows, cold
    )


def _mask(q_len: int, kv_len: int, sliding_window: int | None, device: torch.device) -> torch.Tensor | None:
    """Bottom-right causal mask (True = attend): query i sits at position kv_len - q_len + i."""
    if sliding_window is None and q_len == 1:
        return None
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]  # (q, 1)
    k_pos = torch.arange(kv_len, device=device)[None, :]  # (1, kv)
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    return allowed


def decode_attention(
    query: torch.Tensor,  # (H, T, D): the step's queries
    cache: KVCache,
    layer: int,
    group: DecodeGroup,
    scale: float,
) -> torch.Tensor:
    """Attention of a group of single-token queries to their cached histories: (B, H, D).

    Query heads are grouped over their shared KV head (GQA): one batched matmul over (sequence,
    KV head) pairs, reading a contiguous gather of the cache; softmax in fp32. On CPU this is
    several times faster in bf16 than `scaled_dot_product_attention(enable_gqa=True)`, which
    takes a slow path for single-token queries there. Quantised blocks are read a whole (block,
    KV head) row at a time, dequantised (see `ColdStore.gathered`); their scores and the
    full-precision ones go into one buffer, and their values into the same output.
    """
    num, kv_heads, head_dim = group.rows.shape[0], cache.shape.num_kv_heads, query.shape[-1]
    groups = query.shape[0] // kv_heads
    pairs = (num * kv_heads, group.max_len, head_dim)
    key = cache.keys[layer].view(-1, head_dim).index_select(0, group.head_rows).view(pairs)
    value = cache.values[layer].view(-1, head_dim).index_select(0, group.head_rows).view(pairs)
    # Head kv*G + g attends with KV head kv, as the model's repeat_kv arranges them.
    q = query.index_select(1, group.rows).transpose(0, 1).reshape(num * kv_heads, groups, head_dim)
    cold = None
    if group.cold_rows is not None and cache.cold is not None:
        cold = cache.cold.gathered(layer, group.cold_rows, num * kv_heads)  # (B*KVH, M*bs, D)
        split = cold.keys.shape[1]
        # Both parts' scores straight into one fp32 buffer (quantised history first), no concatenation.
        scores = torch.empty(
            num * kv_heads, groups, split + group.max_len, dtype=torch.float32, device=q.device
        )
        torch.mul(torch.bmm(q, cold.keys.transpose(1, 2)), scale, out=scores[..., :split])
        torch.mul(torch.bmm(q, key.transpose(1, 2)), scale, out=scores[..., split:])
    else:
        scores = torch.bmm(q, key.transpose(1, 2)).float() * scale  # (B*KVH, G, L)
    if group.padding is not None:
        scores.view(num, kv_heads, groups, -1).masked_fill_(group.padding, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    if cold is None:
        return torch.bmm(probs, value).view(num, kv_heads * groups, head_dim)
    out = torch.bmm(probs[..., split:], value)  # (B*KVH, G, D)
    return torch.baddbmm(out, probs[..., :split], cold.values).view(num, kv_heads * groups, head_dim)


def in_place_attention(
    query: torch.Tensor,  # (H, T, D): the step's queries
    cache: KVCache,
    layer: int,
    decodes: InPlaceDecodes,
    scale: float,
) -> torch.Tensor:
    """`decode_attention` for full-precision histories, by the native kernel reading the pool
    where each token lies: (B, H, D). Float32 arithmetic; agrees with the torch path to rounding."""
    if cache.kernel is None:
        raise RuntimeError("in-place decode attention needs the native kernel")
    q = query.index_select(1, decodes.rows).transpose(0, 1).contiguous()  # (B, H, D)
    cold = None
    if decodes.cold_blocks is not None and decodes.cold_starts is not None and cache.cold is not None:
        cold = (cache.cold.layer(layer), cache.cold.parts(layer), decodes.cold_blocks, decodes.cold_starts)
    return cache.kernel.decode_attention(
        q, cache.keys[layer], cache.values[layer], decodes.slots, decodes.starts, scale, cold
    )


def window_attention(query: torch.Tensor, key: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """Attention each key receives from the last `window` queries, summed over them and all
    heads: (L,). query (H, q, D), key (KVH, L, D), the queries being the last of the L tokens."""
    heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[0], key.shape[1]
    w = min(window, q_len)
    q = query[:, -w:].reshape(kv_heads, heads // kv_heads * w, dim)  # heads of one KV head together
    scores = torch.bmm(q, key.transpose(1, 2)).float() * scale  # (KVH, G*w, L)
    q_pos = torch.arange(kv_len - w, kv_len, device=key.device)[:, None]
    future = torch.arange(kv_len, device=key.device)[None, :] > q_pos  # (w, L)
    scores = scores.view(kv_heads, -1, w, kv_len).masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1).sum(dim=(0, 1, 2))


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, H, T, D)
    key: torch.Tensor,  # (1, KVH, T, D)
    value: torch.Tensor,  # (1, KVH, T, D)
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    sliding_window: int | None = None,
    step: StepBatch | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    if step is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention runs only inside an engine step")
    layer = int(getattr(module, "layer_idx"))  # noqa: B009
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    step.cache.write(layer, step.new_slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
    out = torch.empty(query.shape[2], query.shape[1], query.shape[3], dtype=query.dtype, device=query.device)
    if step.in_place is not None:
        out[step.in_place.rows] = in_place_attention(query[0], step.cache, layer, step.in_place, scale)
    for group in step.decodes:
        out[group.rows] = decode_attention(query[0], step.cache, layer, group, scale)
    cache = step.cache
    prompts = cache.prompt_kernel if sliding_window is None else None
    groups = query.shape[1] // cache.shape.num_kv_heads
    reads_cold = cache.cold is not None and cache.cold.rotation is None  # rotated: torch un-rotates
    for seq in step.seqs:
        q = query[:, :, seq.q_start : seq.q_start + seq.q_len]  # (1, H, q, D)
        in_place = seq.cold_blocks is None or reads_cold
        if prompts is not None and in_place and not seq.observe and groups <= 16:
            # history read where it lies (AMX tiles; quantised blocks dequantised on the way): no mask
            cold = None
            if seq.cold_blocks is not None and cache.cold is not None:
                cold = (cache.cold.layer(layer), cache.cold.parts(layer), seq.cold_blocks)
            out[seq.q_start : seq.q_start + seq.q_len] = prompts.prefill_attention(
                q[0], cache.keys[layer], cache.values[layer], seq.kv_slots, scale, cold
            )
            continue
        k, v = step.cache.read(layer, seq.kv_slots, seq.cold_blocks)  # (1, KVH, kv, D)
        mask = _mask(seq.q_len, seq.kv_len, sliding_window, query.device)
        # Prompt chunks: torch's fused CPU/GPU kernel wins once the score matrix is large.
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[seq.q_start : seq.q_start + seq.q_len] = o[0].transpose(0, 1)  # (q, H, D)
        if seq.observe and step.scores is not None:
            step.scores[seq.q_start] += window_attention(q[0], k[0], seq.observe, scale)
    return out.unsqueeze(0), None  # (1, T, H, D), as the model's o_proj expects


def register() -> str:
    """Makes the attention function known to transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    return ATTENTION_NAME
