"""The model behind the analyser (`pipeline.analyzer.AnalysisEngine`), chosen by ANALYZER_BACKEND:

- `embedded` (the default): our own engine in this process, on the bundled model or MODEL_PATH;
  the model's chat template is applied here;
- `openai`: any OpenAI-compatible server (vLLM, llama.cpp's llama-server, Ollama, TGI) at
  OPENAI_BASE_URL (`pipeline.openai_backend`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from engine import EngineOptions, EngineStats, GenerationResult, SamplingParams
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
        self,
        messages: Sequence[dict[str, str]],
        params: SamplingParams | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> GenerationResult:
        ids = self.engine.format_chat(messages)
        if on_text is None:
            return await self.engine.generate(ids, params)
        if params is not None and params.json_schema is not None:
            await self.engine.prepare(params.json_schema)
        handle = self.engine.submit(ids, params)
        try:
            async for piece in handle.stream():
                on_text(piece)
            return await handle.result()
        except asyncio.CancelledError:
            handle.cancel()
            raise

    async def score(self, messages: Sequence[dict[str, str]], continuations: Sequence[str]) -> list[float]:
        return await self.engine.score(self.engine.format_chat(messages), continuations)

    def stats(self) -> EngineStats:
        return self.engine.stats()
