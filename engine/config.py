"""Engine configuration and per-request sampling parameters: frozen, validated on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import NoDecode

Device = Literal["auto", "cpu", "cuda"]
PrunePolicy = Literal["attention", "heuristic"]
DType = Literal["auto", "bfloat16", "float32"]  # auto: bf16 where computed natively, else fp32
KVKernel = Literal["auto", "torch", "avx512", "avx2", "portable"]
PromptAttention = Literal["auto", "torch"]


def kv_part(name: str) -> tuple[int, int, bool]:
    """A KV part named "layer.head.k" (its keys) or "layer.head.v" (its values): (layer, KV head,
    values?)."""
    layer, head, kind = name.split(".")
    return int(layer), int(head), kind == "v"


class EngineOptions(BaseModel):
    """The engine's knobs an operator sets (each one an environment variable of the service, named
    after its field): validated here, once, wherever they come from."""

    model_config = ConfigDict(frozen=True)

    device: Device = "auto"
    dtype: DType = "auto"  # auto: bf16 where computed natively (GPU, bf16 CPUs), else fp32
    dynamic_batching: bool = False  # False: one request at a time (the article's "static batch=1")
    max_batch_size: int = Field(default=8, ge=1, le=256)
    dynamic_batch_window_ms: float = Field(
        default=150.0, ge=0, le=10_000, description="How long the first waiting request may wait for others."
    )
    kv_compression: bool = False  # the compression profile below applies
    kv_quant_bits: int = Field(default=8, description="4, 6, 8, or 16 (no quantisation).")
    kv_int8_layers: Annotated[tuple[int, ...], NoDecode] = Field(
        default=(),
        description="With 4-bit KV: layers (from 0; comma-separated) whose blocks are kept at 8 bits, "
        "the ones where 4-bit error costs the model most.",
    )
    kv_int6_layers: Annotated[tuple[int, ...], NoDecode] = Field(
        default=(),
        description="With 4-bit KV: layers (from 0; comma-separated, none of KV_INT8_LAYERS) whose "
        "blocks are kept at 6 bits.",
    )
    kv_int6_parts: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(),
        description="With 4-bit KV: parts kept at 6 bits whatever their layer's bits, each a layer, a KV "
        "head and k (its keys) or v (its values), comma-separated, e.g. 16.0.k,11.1.v: a KV head's keys "
        "and values are quantised on their own, so each part may hold its own bits.",
    )
    kv_residual_tokens: int = Field(
        default=32, ge=0, le=4096, description="Recent tokens kept full precision."
    )
    kv_rotate: bool = Field(
        default=False, description="Rotate keys and values by a Hadamard matrix before quantising them."
    )
    kv_sink_tokens: int = Field(default=4, ge=0, le=1024, description="First tokens kept full precision.")
    kv_prompt_tokens: int = Field(
        default=0,
        ge=0,
        le=65536,
        description="With quantised KV: full-precision room, in tokens, for prompts being read: a prompt is "
        "read over a full-precision history (as KIVI reads prompts) and its blocks quantised once it "
        "decodes, so what is read at its end (label scores, a probe's state, the first token) sees no "
        "quantisation; while the room is short (a step's tokens and a block per request left) prompts "
        "are read over quantised blocks as without it. Costs these tokens at full precision in the "
        "pool; 0: off.",
    )
    kv_keep_ratio: float = Field(default=1.0, gt=0, le=1, description="Share of each prompt kept (pruning).")
    kv_prune_policy: PrunePolicy = "attention"  # SnapKV-style scores, or the article's heuristic
    kv_observe_tokens: int = Field(default=32, ge=1, le=1024, description="Observation window when pruning.")
    kv_kernel: KVKernel = Field(
        default="auto",
        description="auto: quantised KV blocks read, and decodes attended in place where that build is "
        "faster than torch, by C kernels built at start for this CPU (bf16 decodes by AMX tiles where "
        "it has them); torch: by torch; avx512 (an AMX CPU's build without its tiles), avx2, portable: "
        "the kernels' paths for an older CPU (to measure them on a newer one).",
    )
    prompt_attention: PromptAttention = Field(
        default="auto",
        description="auto: bf16 prompt chunks attended where their history lies by the KV_KERNEL build "
        "(AMX tiles, or AVX-512 BF16 vectors; head size a multiple of 64); torch: SDPA over a gathered "
        "copy, as on CPUs without them.",
    )
    max_tokens_per_step: int = Field(default=192, ge=1, description="Prefill chunks + decodes per forward.")
    saturated_tokens_per_step: int | None = Field(
        default=None,
        ge=0,
        description="Prefill chunks + decodes per forward while MAX_BATCH_SIZE requests or more are running "
        "or waiting (a backlog: larger steps read its prompts faster); unset: twice MAX_TOKENS_PER_STEP; "
        "0: MAX_TOKENS_PER_STEP always.",
    )
    decode_defer_steps: int = Field(
        default=0,
        ge=0,
        description="Steps in a row that running decodes give way to prompts waiting to be read (a "
        "burst's prompts read first, as vLLM's large steps do); 0: decodes first in every step.",
    )
    speculative_tokens: int = Field(
        default=4,
        ge=0,
        le=16,
        description="Greedy decodes propose up to this many draft tokens by prompt lookup (what followed "
        "the latest earlier occurrence of their last tokens in their own prompt or output) and verify "
        "them in one step, in steps of decodes alone; the greedy output in exact arithmetic (in bf16 a "
        "near-tie can flip, as with batching order); 0: off.",
    )
    speculative_step_tokens: int | None = Field(
        default=None,
        ge=0,
        description="A step of decodes alone carries at most this many tokens, decodes and their draft "
        "tokens, shared out equally among its decodes (each at most SPECULATIVE_TOKENS): 64 gives a full "
        "batch of 32 one guess each and a dozen decodes or fewer SPECULATIVE_TOKENS; 0: the step's budget "
        "alone bounds them, decode by decode; unset: 64 on a CPU without AMX (its products turn bound by "
        "compute at 32-64 rows, so a full batch's guesses cost what tokens cost), 0 elsewhere.",
    )
    max_model_len: int = Field(
        default=8192,
        ge=16,
        description="Longest request (prompt + new tokens) in tokens; the model's context if less.",
    )
    kv_cache_bytes: int | None = Field(
        default=None,
        ge=1,
        description="KV pool budget; default: what the batch can use (max_batch_size requests of "
        "max_model_len tokens), at most kv_cache_memory_fraction of free memory.",
    )
    kv_cache_memory_fraction: float = Field(default=0.2, gt=0, le=0.95)
    prefix_caching: bool = Field(default=True, description="Reuse the KV blocks of shared prompt prefixes.")
    fuse_layers: bool = Field(
        default=True,
        description="RMSNorm, the rotary embedding and the MLP's SiLU * up each in one pass by the "
        "engine's C kernels, q/k/v by one product (CPU; SiLU * up where the CPU has AVX-512 with "
        "bf16); false: transformers' modules.",
    )
    prepack_weights: bool = Field(
        default=True,
        description="Linear weights and the output head reordered once for oneDNN (CPU; fp32, or bf16 "
        "where the CPU has it natively).",
    )

    @field_validator("kv_quant_bits")
    @classmethod
    def _quant_bits(cls, value: int) -> int:
        if value not in (4, 6, 8, 16):
            raise ValueError("must be 4, 6, 8 or 16")
        return value

    @field_validator("kv_int8_layers", "kv_int6_layers", mode="before")
    @classmethod
    def _layer_list(cls, value: object) -> object:
        if isinstance(value, str):
            parts = [part.strip() for part in value.split(",") if part.strip()]
            if not all(part.isdigit() for part in parts):
                raise ValueError(f"{value!r}: layer numbers separated by commas, e.g. 9,11,13")
            return tuple(int(part) for part in parts)
        return value

    @field_validator("kv_int8_layers", "kv_int6_layers")
    @classmethod
    def _layers_named_once(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(layer < 0 for layer in value) or len(set(value)) != len(value):
            raise ValueError("layers are numbered from 0, each named once")
        return tuple(sorted(value))

    @field_validator("kv_int6_parts", mode="before")
    @classmethod
    def _part_list(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("kv_int6_parts")
    @classmethod
    def _parts_named_once(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if wrong := [part for part in value if not re.fullmatch(r"\d+\.\d+\.[kv]", part)]:
            raise ValueError(f"{wrong}: parts are layer.head.k or layer.head.v, e.g. 16.0.k,11.1.v")
        if len(set(value)) != len(value):
            raise ValueError("parts are named once each")
        return tuple(sorted(value, key=kv_part))

    @property
    def int6_parts(self) -> dict[tuple[int, int, bool], int]:
        """KV_INT6_PARTS as (layer, KV head, values?) -> 6."""
        return dict.fromkeys(map(kv_part, self.kv_int6_parts), 6)

    @property
    def pruning(self) -> bool:
        return self.kv_compression and self.kv_keep_ratio < 1

    @property
    def quantising(self) -> bool:
        return self.kv_compression and self.kv_quant_bits < 16

    @property
    def effective_batch_size(self) -> int:
        return self.max_batch_size if self.dynamic_batching else 1

    @property
    def saturated_budget(self) -> int:
        """The step budget while saturated: SATURATED_TOKENS_PER_STEP, or twice MAX_TOKENS_PER_STEP
        when unset (0: no other budget)."""
        if self.saturated_tokens_per_step is None:
            return 2 * self.max_tokens_per_step
        return self.saturated_tokens_per_step

    def options(self) -> dict[str, Any]:
        """These knobs alone, as keyword arguments (for `EngineConfig.of`)."""
        return {name: getattr(self, name) for name in EngineOptions.model_fields}


class EngineConfig(EngineOptions):
    """What one engine runs with: the operator's options, the model, and two settings of its own."""

    model_path: Path
    block_size: int = Field(default=16, ge=1)  # tokens per KV block
    num_threads: int | None = Field(default=None, ge=1)  # torch intra-op threads on CPU; None: torch's

    @classmethod
    def of(cls, options: EngineOptions, model_path: Path) -> EngineConfig:
        return cls(model_path=model_path, **options.options())


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
    # Tokens whose logits an observer sees as the output head's product in fp32 rather than rounded
    # to the model's dtype (bf16 rounds a logit near 20 to 1/8): label scores compare a few words,
    # and rounded, a sixth of documents tied exactly between yes and no (`engine.scoring`).
    exact_ids: tuple[int, ...] = ()

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
