"""KV compression policy: the one place that decides which blocks are quantised and which tokens
are dropped; it hands the scheduler's bookkeeping and the runner's tensors plain moves.

* Quantising: every step, full blocks that have left each holder's recent window (the last
  `residual_tokens`, the first `sink_tokens` kept too) move to quantised storage while quantised
  blocks are free (`Compressor.moves`). A block shared by several sequences (an adopted prefix)
  moves once it has left every sharer's window.
* Pruning: once a prompt has been read, its cached tokens are scored and the best `keep_ratio`
  kept, compacted to the front of its blocks, the rest released (`Compressor.prune`). Two
  scoring policies over the tokens between the sinks and the observation window:
  - `attention` (SnapKV): the attention the last `window` prompt tokens (the instruction to
    answer) pay to each earlier token, summed over heads and layers during the final prompt
    chunk, then max-pooled over neighbours so that kept tokens come with their context;
  - `heuristic` (the article's rule, as a baseline): punctuation, function words and repeated
    bigrams score 0, every other token 1; ties keep the later tokens.
  Keys are cached after RoPE, so kept tokens keep their positions: only the cache indices change.
* Sizing: how much of the KV byte budget is full precision (every running sequence's sinks,
  recent window and one step's prompt chunk) and how much quantised (`build_cache`).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from engine import kv_native
from engine.block_manager import BlockManager
from engine.config import EngineConfig, KVKernel, PrunePolicy
from engine.kv_cache import ColdStore, KVCache, KVShape
from engine.kv_quant import layer_formats, part_formats
from engine.loader import cpu_flags
from engine.sequence import Sequence

# fmt: off
FUNCTION_WORDS = frozenset([
    "的", "了", "是", "在", "和", "与", "及", "也", "就", "都", "而", "或", "着", "过",
    "吗", "呢", "吧", "啊", "之", "其", "这", "那", "把", "被", "对", "从", "向",
    "a", "an", "the", "of", "to", "in", "on", "at", "by", "for", "and", "or", "but", "is", "are", "was",
    "were", "be", "been", "it", "its", "this", "that", "with", "as",
])
# fmt: on


def smooth(scores: torch.Tensor, kernel: int = 7) -> torch.Tensor:
    """Max-pools scores over a window of neighbours (odd `kernel`), as SnapKV does."""
    if kernel <= 1:
        return scores
    return F.max_pool1d(scores[None, None], kernel, stride=1, padding=kernel // 2)[0, 0]


def heuristic_scores(token_ids: Seq[int], text_of: Callable[[int], str]) -> torch.Tensor:
    """1 for a content token, 0 for punctuation, a function word or a repeated bigram."""
    scores = torch.ones(len(token_ids))
    seen: set[tuple[int, int]] = set()
    for i, token in enumerate(token_ids):
        text = text_of(token).strip().lower()
        if not text or all(unicodedata.category(c)[0] in "PSZC" for c in text) or text in FUNCTION_WORDS:
            scores[i] = 0
        if i:
            pair = (token_ids[i - 1], token)
            if pair in seen:
                scores[i] = 0
            seen.add(pair)
    return scores


def select_kept(scores: torch.Tensor, keep_ratio: float, sinks: int, window: int) -> torch.Tensor:
    """Sorted indices of the tokens to keep among `len(scores)`: sinks, window, and the best rest.

    Ties go to later tokens (closer to the question being answered)."""
    total = int(scores.shape[0])
    budget = max(sinks + window, round(keep_ratio * total))
    if budget >= total:
        return torch.arange(total)
    middle = scores[sinks : total - window].float()
    # A tiny ramp makes later tokens win ties without changing any real ordering.
    ramp = torch.linspace(0, 1e-6, middle.shape[0]) * (middle.abs().max() + 1)
    chosen = (middle + ramp).topk(budget - sinks - window).indices + sinks
    head, tail = torch.arange(min(sinks, total)), torch.arange(max(sinks, total - window), total)
    kept, _ = torch.sort(torch.cat((head, chosen, tail)))
    return kept


@dataclass(frozen=True)
class Moves:
    """KV data to move before a step's forward, in cache slots and pool block ids: (source slots,
    destination slots) copies that compact pruned sequences, then (full-precision, quantised)
    block pairs to quantise."""

    copies: list[tuple[list[int], list[int]]] = field(default_factory=list)
    settle: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class CompressionConfig:
    quantising: bool = False  # full blocks out of the recent window move to quantised storage
    residual_tokens: int = 32  # the most recent tokens of each sequence stay full precision
    sink_tokens: int = 4  # so do the first ones, rounded up to whole blocks
    pruning: bool = False  # prompts are pruned to `keep_ratio` once read
    keep_ratio: float = 1.0
    observe_tokens: int = 32  # the observation window that scores (and is kept) when pruning
    policy: PrunePolicy = "attention"
    prompts_full_precision: bool = False  # a prompt's blocks are quantised once it decodes...
    reserve_blocks: int = 0  # ...while more full-precision blocks than this (and one per sequence) are free

    @classmethod
    def of(cls, config: EngineConfig) -> CompressionConfig:
        step = max(config.max_tokens_per_step, config.saturated_budget)
        return cls(
            config.quantising, config.kv_residual_tokens, config.kv_sink_tokens, config.pruning,
            config.kv_keep_ratio, config.kv_observe_tokens, config.kv_prune_policy,
            config.kv_prompt_tokens > 0, -(-step // config.block_size),
        )  # fmt: skip

    @property
    def prune_window(self) -> int:
        """Tokens every final prompt chunk must hold (0: no pruning)."""
        return self.observe_tokens if self.pruning else 0

    @property
    def attention_window(self) -> int:
        """Queries whose attention scores a prompt's keys (0: no attention scoring)."""
        return self.observe_tokens if self.pruning and self.policy == "attention" else 0


class Compressor:
    """Decides, step by step, which blocks of the running sequences are quantised and which of a
    read prompt's tokens are dropped; changes the block tables (through `BlockManager`) and hands
    the runner the data moves that go with them (`moves`), applied before the next forward."""

    def __init__(
        self, config: CompressionConfig, blocks: BlockManager, text_of: Callable[[int], str]
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.text_of = text_of  # a token's text, for the heuristic scores
        self.sink_blocks = -(-config.sink_tokens // blocks.block_size)
        self._copies: list[tuple[list[int], list[int]]] = []  # pruning moves for the next step

    def wants_pruning(self, seq: Sequence) -> bool:
        return self.config.pruning and not seq.pruned

    def prune(self, seq: Sequence, attention: torch.Tensor | None) -> None:
        """Its prompt is read: keep the sinks, the observation window and the best-scored rest.
        Attention scores where the runner gave them, else the article's heuristic (also when the
        final chunk was one token)."""
        if attention is not None:
            scores = smooth(attention)
        else:
            scores = heuristic_scores(seq.token_ids[: seq.num_cached], self.text_of)
        config = self.config
        self.drop(
            seq, select_kept(scores, config.keep_ratio, config.sink_tokens, config.observe_tokens).tolist()
        )

    def drop(self, seq: Sequence, kept: Seq[int]) -> None:
        """Keeps only the cached tokens at indices `kept` (sorted), compacted to the front of its
        blocks, the rest released; the copy is handed out with the next `moves`. A shared block
        must not be overwritten: such a sequence (none while pruning turns prefix caching off)
        keeps everything."""
        seq.pruned = True
        total, count = seq.num_cached, len(kept)
        if count >= total or not self.blocks.is_private(seq.seq_id):
            return
        size, table = self.blocks.block_size, self.blocks.table(seq.seq_id)
        source = [table[i // size] * size + i % size for i in kept]
        destination = [
            table[i // size] * size + i % size for i in range(count)
        ]  # index i moves to i <= its own
        self.blocks.truncate(seq.seq_id, count)
        seq.num_dropped += total - count
        seq.num_settled_blocks = 0
        self._copies.append((source, destination))

    def moves(self, running: Iterable[Sequence]) -> Moves:
        """The pruning copies decided since the last step, and the blocks to quantise now."""
        copies, self._copies = self._copies, []
        return Moves(copies, self._settle(list(running)) if self.config.quantising else [])

    def _settle(self, running: list[Sequence]) -> list[tuple[int, int]]:
        """Moves full blocks that left the recent-token window to quantised storage while quantised
        blocks are free: the (full-precision, quantised) pairs to copy. Sink blocks stay; so do the
        blocks of a prompt being read, with `prompts_full_precision` (KV_PROMPT_TOKENS), while the pool
        has room for a step and a block per sequence beyond them (else they go too: the pool must
        never hold up the requests it serves)."""
        moves: list[tuple[int, int]] = []
        if not self.blocks.num_cold_blocks:
            return moves
        reading = self.config.prompts_full_precision and (
            self.blocks.num_free >= self.config.reserve_blocks + len(running)
        )
        holders: dict[int, list[tuple[int, int]]] = {}  # hot block -> (sequence, index) of each user
        in_window: set[int] = set()  # hot blocks some user still needs in full precision
        for seq in running:
            table = self.blocks.table(seq.seq_id)
            if self.wants_pruning(seq) or (reading and not seq.is_decoding):
                limit = 0  # its prompt is still read in full precision (to be scored and pruned)
            else:
                limit = (seq.num_cached - self.config.residual_tokens) // self.blocks.block_size
            first = max(seq.num_settled_blocks, self.sink_blocks)
            for index in range(first, len(table)):
                block = table[index]
                if not self.blocks.is_cold(block):
                    holders.setdefault(block, []).append((seq.seq_id, index))
                    if index >= limit:
                        in_window.add(block)
        keep = self.config.prompts_full_precision  # new prompts adopt the full-precision copy
        for block, where in holders.items():
            if not self.blocks.num_free_cold:
                break
            if block not in in_window and (cold := self.blocks.settle(block, where, keep)) is not None:
                moves.append((block, cold))
        for seq in running:  # skip what is settled; a block still hot is looked at again
            table = self.blocks.table(seq.seq_id)
            index = max(seq.num_settled_blocks, self.sink_blocks)
            while index < len(table) and self.blocks.is_cold(table[index]):
                index += 1
            seq.num_settled_blocks = index
        return moves


def pool_cap(config: EngineConfig, device: torch.device) -> int:
    """The most the KV pool may take: KV_CACHE_BYTES, else a share of free memory."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        import psutil

        free = psutil.virtual_memory().available
    return int(free * config.kv_cache_memory_fraction)


def build_cache(config: EngineConfig, shape: KVShape, device: torch.device, max_len: int) -> KVCache:
    """The pool. Its size: KV_CACHE_BYTES when set; else what the batch can use, every running
    sequence at `max_len` tokens, within a share of free memory. Uncompressed: all full-precision
    blocks. Compressed: enough full-precision blocks for every running sequence's sinks, recent
    window and one step's prompt chunk (and KV_PROMPT_TOKENS for prompts being read), the rest as
    quantised blocks. On a CPU the native kernel
    reads quantised blocks, and attends decodes in place where its build does that faster than
    torch's gathered path (`NativeKernel.attends_faster`), and bf16 prompt chunks where its build
    can (`NativeKernel.prompt_isa`) unless PROMPT_ATTENTION=torch."""
    cap, size = pool_cap(config, device), config.block_size
    hot_bytes = shape.bytes_per_token * size
    native = config.kv_kernel != "torch" and device.type == "cpu" and shape.dtype in kv_native.DTYPES
    kernel = kv_native.load(kernel_target(config.kv_kernel)) if native else None
    if kernel is not None and config.kv_kernel == "avx512":  # this build's AVX-512 path, tiles unused
        kernel = replace(kernel, tiles=False)
    attends = kernel if kernel is not None and kernel.attends_faster(shape.dtype) else None
    in_place = config.prompt_attention == "auto"
    # with the default budget, blocks beyond every running sequence at full length would stay idle
    usable = None if config.kv_cache_bytes is not None else config.effective_batch_size * -(-max_len // size)
    if not config.quantising:
        blocks = cap // hot_bytes if usable is None else min(cap // hot_bytes, usable)
        return KVCache(shape, max(1, blocks), size, device, kernel=attends, prompts_in_place=in_place)
    layers = layer_formats(
        shape.num_layers, config.kv_quant_bits, config.kv_int8_layers, config.kv_int6_layers
    )
    fmt = part_formats(layers, shape.num_kv_heads, config.int6_parts)
    per_seq = -(-config.kv_sink_tokens // size) + -(-config.kv_residual_tokens // size) + 2
    step = max(config.max_tokens_per_step, config.saturated_budget)  # a step's new tokens
    hot_needed = config.effective_batch_size * per_seq + -(-step // size)
    if config.pruning:  # prompts stay full precision until they are scored: room for a few long ones
        hot_needed += -(-4096 // size)
    hot_needed += -(-config.kv_prompt_tokens // size)  # prompts read over a full-precision history
    hot = min(max(1, cap // hot_bytes), hot_needed)
    cold = max(0, cap - hot * hot_bytes) // ColdStore.bytes_per_block(shape, fmt, size)
    if usable is not None:
        cold = min(cold, usable)
    if not cold:
        return KVCache(shape, hot, size, device, kernel=attends, prompts_in_place=in_place)
    cold_store = ColdStore(shape, fmt, cold, size, device, kernel, rotate=config.kv_rotate)
    return KVCache(shape, hot, size, device, cold_store, attends, prompts_in_place=in_place)


# KV_KERNEL=avx512: the native build's own AVX-512 path (its AMX tiles unused), and what it needs.
AVX512_BF16 = frozenset({"avx512f", "avx512bw", "avx512_bf16"})
# An older CPU's kernel path: its compiler target (-march) and the CPU flags it needs.
OLDER_PATHS = {"avx2": ("haswell", frozenset({"avx2", "fma"})), "portable": ("x86-64", frozenset({"sse2"}))}


def kernel_target(kernel: KVKernel) -> str:
    """The compiler target (`-march`) of a native KV kernel choice; refuses a path this CPU lacks
    (running it would stop the process on an illegal instruction)."""
    if kernel == "avx512" and not cpu_flags() >= AVX512_BF16:
        raise ValueError(f"KV_KERNEL=avx512 needs a CPU with {', '.join(sorted(AVX512_BF16))}")
    if kernel not in OLDER_PATHS:
        return "native"
    march, needs = OLDER_PATHS[kernel]
    if not needs <= cpu_flags():
        raise ValueError(f"KV_KERNEL={kernel} needs a CPU with {', '.join(sorted(needs))}")
    return march
