"""Start-up self-test: the engine against plain recomputation on tiny models of each supported
architecture, with chunked prefill and requests joining mid-flight. Catches a transformers upgrade
that changes what reaches the attention function, before any real document is analysed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from engine.config import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.loader import SUPPORTED_MODEL_TYPES, LoadedModel
from engine.request import EngineError
from engine.tiny import Architecture, build_tiny

log = logging.getLogger(__name__)

_PROMPTS = [
    "hello there",
    "会议决定下季度增加预算，客户投诉处理时间缩短到两天。",
    "Revenue grew 12% year over year.",
]


@contextlib.contextmanager
def stock_attention(loaded: LoadedModel) -> Iterator[None]:
    """The model with transformers' own SDPA attention, for references outside the engine."""
    previous = loaded.model.config._attn_implementation
    loaded.model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        loaded.model.set_attn_implementation(previous)


@torch.inference_mode()
def recompute(loaded: LoadedModel, ids: list[int], n: int) -> list[int]:
    """Greedy decoding by full recomputation, one request alone, EOS ignored (no cache involved)."""
    seq = list(ids)
    with stock_attention(loaded):
        for _ in range(n):
            seq.append(int(loaded.model(torch.tensor([seq], device=loaded.device)).logits[0, -1].argmax()))
    return seq[len(ids) :]


async def _check(architecture: Architecture, device: torch.device) -> None:
    tiny = build_tiny(architecture, device=device)
    config = EngineConfig(
        model_path=Path("tiny"), dtype="float32", dynamic_batching=True, max_batch_size=3,
        dynamic_batch_window_ms=5, kv_cache_bytes=1 << 22, max_tokens_per_step=8,
    )  # fmt: skip
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    async with Engine(config, tiny) as engine:
        ids = [engine.format_chat([{"role": "user", "content": p}]) for p in _PROMPTS]
        results = await asyncio.gather(*(engine.generate(i, params) for i in ids))
    for prompt_ids, result in zip(ids, results, strict=True):
        if result.token_ids != recompute(tiny, prompt_ids, 6):
            raise EngineError(f"engine self-test failed on a tiny {architecture} model: outputs differ")


def self_test(device: torch.device | None = None) -> None:
    """Raises EngineError when the engine does not reproduce the reference on every architecture,
    on the device the engine will run on (the CPU unless told)."""
    device = device or torch.device("cpu")
    for architecture in SUPPORTED_MODEL_TYPES:
        asyncio.run(_check(architecture, device))
    log.info("engine self-test passed on %s (%s)", device, ", ".join(SUPPORTED_MODEL_TYPES))
