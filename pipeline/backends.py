"""The model behind the analyser (`pipeline.analyzer.AnalysisEngine`), chosen by ANALYZER_BACKEND:

- `embedded` (the default): our own engine in this process, on the bundled model or MODEL_PATH;
  the model's chat template is applied here;
- `openai`: any OpenAI-compatible server (vLLM, llama.cpp's llama-server, Ollama, TGI) at
  OPENAI_BASE_URL (`pipeline.openai_backend`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine import EngineOptions, EngineStats, GenerationResult, SamplingParams
from pipeline.analyzer import Messages, OnText
from pipeline.telemetry import PROVIDER

if TYPE_CHECKING:
    from engine import Engine


class EmbeddedBackend:
    """The in-process engine, spoken to in chat messages."""

    provider = PROVIDER

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def model_id(self) -> str:
        return self.engine.model_id

    @property
    def config(self) -> EngineOptions:
        return self.engine.config

    async def prepare(self, json_schema: str) -> None:
        await self.engine.prepare(json_schema)

    async def generate(
        self, messages: Messages, params: SamplingParams | None = None, on_text: OnText | None = None
    ) -> GenerationResult:
        return await self.engine.generate(self.engine.format_chat(messages), params, on_text)

    async def score(self, messages: Messages, continuations: Sequence[str]) -> list[float]:
        return await self.engine.score(self.engine.format_chat(messages), continuations)

    async def hidden(self, messages: Messages, depth: int) -> list[float]:
        state = await self.engine.hidden(self.engine.format_chat(messages), depth)
        return [float(v) for v in state.tolist()]

    def stats(self) -> EngineStats:
        return self.engine.stats()
