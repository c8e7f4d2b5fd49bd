"""Engine configuration and per-request sampling parameters: frozen, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Device = Literal["auto", "cpu", "cuda"]
PrunePolicy = Literal["attention", "heuristic"]
DType = Literal["auto", "bfloat16", "float32"]  # auto: bf16 where computed natively, else fp32
KVKernel = Literal["auto", "torch"]


@dataclass(frozen=True)
class EngineConfig:
    model_path: Path
    device: Device = "auto"
    dtype: DType = "auto"
    dynamic_batching: bool = False  # False: one request at a time (the article's "static batch=1")
    max_batch_size: int = 8
    batch_window_ms: float = 150.0  # how long the first waiting request may wait for others to join
    kv_compression: bool = False  # the compression profile below applies
    kv_quant_bits: int = 8  # 8 or 4: quantise blocks that leave the recent window; 16: do not
    kv_residual_tokens: int = 32  # the most recent tokens of each sequence stay full precision
    kv_sink_tokens: int = 4  # so do the first ones (attention sinks), rounded up to whole blocks
    kv_keep_ratio: float = 1.0  # < 1: prune each prompt to this share of its tokens once read
    kv_prune_policy: PrunePolicy = "attention"  # SnapKV-style scores, or the article's heuristic
    kv_observe_tokens: int = 32  # the observation window that scores (and is kept) when pruning
    kv_kernel: KVKernel = "auto"  # auto: quantised blocks read by the C kernel on CPU (kv_native)
    kv_cache_bytes: int | None = None  # KV pool budget; None: kv_cache_memory_fraction of free memory
    kv_cache_memory_fraction: float = 0.2
    block_size: int = 16  # tokens per KV block
    max_tokens_per_step: int = 192  # prefill chunks + decodes in one forward (CPU; larger on GPU)
    prefix_caching: bool = True  # reuse the KV blocks of a prompt prefix already computed
    num_threads: int | None = None  # torch intra-op threads on CPU; None keeps torch's default

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.batch_window_ms < 0:
            raise ValueError(f"batch_window_ms must be >= 0, got {self.batch_window_ms}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if not 0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 0.95], got {self.kv_cache_memory_fraction}"
            )
        if self.block_size < 1 or self.max_tokens_per_step < 1:
            raise ValueError("block_size and max_tokens_per_step must be >= 1")
        if self.kv_quant_bits not in (4, 8, 16):
            raise ValueError(f"kv_quant_bits must be 4, 8 or 16 (none), got {self.kv_quant_bits}")
        if not 0 < self.kv_keep_ratio <= 1 or self.kv_observe_tokens < 1:
            raise ValueError("kv_keep_ratio must be in (0, 1] and kv_observe_tokens >= 1")
        if self.kv_residual_tokens < 0 or self.kv_sink_tokens < 0:
            raise ValueError("kv_residual_tokens and kv_sink_tokens must be >= 0")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")

    @property
    def pruning(self) -> bool:
        return self.kv_compression and self.kv_keep_ratio < 1

    @property
    def quantising(self) -> bool:
        return self.kv_compression and self.kv_quant_bits < 16

    @property
    def effective_batch_size(self) -> int:
        return self.max_batch_size if self.dynamic_batching else 1


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False  # benchmarks generate a fixed number of tokens
    json_schema: str | None = None  # constrain the output to JSON valid under this schema (xgrammar)
    stop: tuple[str, ...] = ()  # finish when the text contains one of these; it is cut from the result
    forced_ids: tuple[int, ...] = ()  # teacher forcing (evaluation): emit these tokens, in order

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.forced_ids and (self.json_schema is not None or len(self.forced_ids) < self.max_new_tokens):
            raise ValueError("forced_ids must cover max_new_tokens and cannot be combined with json_schema")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
