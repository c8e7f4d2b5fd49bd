"""A worker process for the pipeline benchmark: the real `Service` (decode, spans, metrics, publish,
offset tracking, commits) with an analyser that answers at once, so what is measured is the
pipeline itself. Settings from the environment; stops on SIGTERM."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider

from engine import EngineConfig, EngineError, EngineStats, GenerationResult, SamplingParams
from pipeline.service import Service
from pipeline.settings import load_settings
from pipeline.telemetry import setup_telemetry
from pipeline.workers import stop_on_signals

# The narrative the model would write, per prompt language (labels come from `score`).
ANSWERS = {
    lang: json.dumps(
        {
            "core_viewpoint": viewpoint,
            "key_information": {"facts": [], "data": [], "conclusions": []},
            "rationale": why,
        },
        ensure_ascii=False,
    )
    for lang, viewpoint, why in (
        ("en", "The pipeline benchmark's instant analyser wrote no analysis.", "No model ran."),
        ("zh", "流水线基准测试的即时分析器没有做分析。", "没有运行模型。"),
    )
}


class InstantEngine:
    """Answers every prompt with the same valid analysis, without a model."""

    model_id = "instant"
    provider = "instant"

    async def score(self, messages: Sequence[dict[str, str]], continuations: Sequence[str]) -> list[float]:
        return [-float(i) for i in range(len(continuations))]

    async def prepare(self, json_schema: str) -> None:
        pass

    async def hidden(self, messages: Sequence[dict[str, str]], depth: int) -> list[float]:
        raise EngineError("the instant engine has no hidden states")

    async def generate(
        self,
        messages: Sequence[dict[str, str]],
        params: SamplingParams | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> GenerationResult:
        chinese = messages[0]["content"].startswith("你")  # the prompt's language: the answer's
        return GenerationResult(
            text=ANSWERS["zh" if chinese else "en"], token_ids=[0], prompt_tokens=len(messages), finish_reason="stop",
            queued_s=0.0, ttft_s=0.0, total_s=0.0, batch_size=1,
        )  # fmt: skip

    @property
    def config(self) -> EngineConfig:
        return EngineConfig(model_path=Path("instant"))

    def stats(self) -> EngineStats:
        return EngineStats(
            model_id="instant", device="cpu", dtype="none", num_waiting=0, num_running=0, num_steps=0, num_finished=0,
            num_generated_tokens=0, num_preemptions=0, mean_batch_size=0.0, largest_batch=0,
            kv_total_bytes=0, kv_used_bytes=0, kv_bytes_per_token=1, kv_tokens=0, kv_quant_bits=None,
            kv_cold_bytes_per_token=0.0, kv_reader=None, decode_reader="torch", prefix_caching=False, prefix_cached_blocks=0, prefix_hit_tokens=0,
        )  # fmt: skip


async def main() -> None:
    settings = load_settings(polarity_from="question")  # the instant engine has no hidden states
    service = Service(settings, InstantEngine(), setup_telemetry(settings, TracerProvider()))
    await service.run(stop_on_signals())


if __name__ == "__main__":
    asyncio.run(main())
