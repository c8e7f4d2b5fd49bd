"""One document -> one validated analysis: render the prompt, generate, parse, repair once.

Owns the analysis spans (`analyze`, with `queue_wait` and `generate` children carrying `gen_ai.*`
attributes). Talks to the engine only through `AnalysisEngine`, so a stand-in engine can serve
delivery tests.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from opentelemetry import trace

from engine import EngineError, EngineStats, GenerationResult, SamplingParams
from pipeline.codec import Document
from prompts import AnalysisParseError, Prompt, parse_analysis, render, render_repair
from schemas import Analysis, DeadLetterReason, DocumentKind, Language, analysis_json_schema


class AnalysisEngine(Protocol):
    @property
    def model_id(self) -> str: ...

    def format_chat(self, messages: Sequence[dict[str, str]]) -> list[int]: ...

    async def prepare(self, json_schema: str) -> None: ...

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None
    ) -> GenerationResult: ...

    def stats(self) -> EngineStats: ...


@dataclass(frozen=True)
class AnalysisOutcome:
    analysis: Analysis
    attempts: int
    prompt_tokens: int
    output_tokens: int
    queued_s: float  # consume -> first forward of the first attempt
    ttft_s: float  # consume -> first token of the first attempt
    batch_size: int  # the largest engine step its sequences ran in


class AnalysisFailed(Exception):
    """No valid analysis: the dead-letter reason, the last raw output (if any), attempts made."""

    def __init__(self, reason: DeadLetterReason, message: str, raw_output: str | None, attempts: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.raw_output = raw_output
        self.attempts = attempts


class Analyzer:
    def __init__(
        self, engine: AnalysisEngine, tracer: trace.Tracer, *, max_new_tokens: int, attempts: int
    ) -> None:
        self.engine = engine
        self.tracer = tracer
        self.params = {
            (kind, language): SamplingParams(
                max_new_tokens=max_new_tokens, json_schema=json.dumps(analysis_json_schema(kind, language))
            )
            for kind in DocumentKind
            for language in Language
        }
        self.max_new_tokens = max_new_tokens
        self.attempts = attempts

    async def prepare(self) -> None:
        """Compiles every kind x language grammar ahead of the first documents, one at a time
        (each takes seconds; a document whose grammar is not ready yet waits for it)."""
        for params in self.params.values():
            if params.json_schema is not None:
                await self.engine.prepare(params.json_schema)

    async def analyze(self, document: Document, consumed_at: float) -> AnalysisOutcome:
        prompt = render(document.kind, document.language, document.text)
        prompt_tokens = output_tokens = batch_size = 0
        first: tuple[float, float] | None = None
        raw: str | None = None
        with self.tracer.start_as_current_span("analyze") as span:
            span.set_attributes(
                {
                    "gen_ai.operation.name": "chat",
                    "gen_ai.system": "deepanalyze",
                    "gen_ai.request.model": self.engine.model_id,
                    "gen_ai.request.max_tokens": self.max_new_tokens,
                    "deepanalyze.document.kind": document.kind.value,
                    "deepanalyze.document.language": document.language.value,
                    "deepanalyze.document.chars": len(document.text),
                }
            )
            for attempt in range(1, self.attempts + 1):
                result, submitted = await self._generate(
                    prompt, self.params[document.kind, document.language], attempt
                )
                prompt_tokens += result.prompt_tokens
                output_tokens += result.output_tokens
                batch_size = max(batch_size, result.batch_size)
                if first is None:
                    lag = submitted - consumed_at
                    first = (lag + result.queued_s, lag + result.ttft_s)
                raw = result.text
                try:
                    analysis = parse_analysis(raw, document.kind)
                except AnalysisParseError as exc:
                    span.add_event("invalid_output", {"attempt": attempt, "error": str(exc)[:500]})
                    if attempt == self.attempts:
                        span.set_attribute("deepanalyze.attempts", attempt)
                        raise AnalysisFailed(
                            DeadLetterReason.MODEL_OUTPUT_INVALID, str(exc), raw, attempt
                        ) from exc
                    prompt = render_repair(prompt, raw, str(exc))
                    continue
                span.set_attributes(
                    {
                        "gen_ai.usage.input_tokens": prompt_tokens,
                        "gen_ai.usage.output_tokens": output_tokens,
                        "deepanalyze.attempts": attempt,
                    }
                )
                return AnalysisOutcome(analysis, attempt, prompt_tokens, output_tokens, *first, batch_size)
        raise AssertionError("unreachable: attempts >= 1")  # pragma: no cover

    async def _generate(
        self, prompt: Prompt, params: SamplingParams, attempt: int
    ) -> tuple[GenerationResult, float]:
        """The result and when it was submitted (perf_counter)."""
        ids = self.engine.format_chat(prompt.messages)
        submitted = time.perf_counter()
        submitted_ns = time.time_ns()
        try:
            result = await self.engine.generate(ids, params)
        except EngineError as exc:
            raise AnalysisFailed(DeadLetterReason.GENERATION_FAILED, str(exc), None, attempt) from exc
        # The engine measures on its own clock; lay its phases out as spans after the fact:
        # queue_wait, then `chat <model>` split into prefill (to the first token) and decode.
        scheduled_ns = submitted_ns + int(result.queued_s * 1e9)
        first_ns = submitted_ns + int(result.ttft_s * 1e9)
        finished_ns = submitted_ns + int(result.total_s * 1e9)
        self.tracer.start_span(
            "queue_wait", start_time=submitted_ns, attributes={"deepanalyze.attempt": attempt}
        ).end(end_time=scheduled_ns)
        generate = self.tracer.start_span(
            f"chat {self.engine.model_id}",
            kind=trace.SpanKind.CLIENT,
            start_time=scheduled_ns,
            attributes={
                "gen_ai.operation.name": "chat",
                "gen_ai.request.model": self.engine.model_id,
                "gen_ai.usage.input_tokens": result.prompt_tokens,
                "gen_ai.usage.output_tokens": result.output_tokens,
                "gen_ai.response.finish_reasons": [result.finish_reason],
                "gen_ai.server.time_to_first_token": result.ttft_s,
                "deepanalyze.engine.batch_size": result.batch_size,
                "deepanalyze.attempt": attempt,
            },
        )
        inside = trace.set_span_in_context(generate)
        phases = (
            ("prefill", scheduled_ns, first_ns, {"gen_ai.usage.input_tokens": result.prompt_tokens}),
            ("decode", first_ns, finished_ns, {"gen_ai.usage.output_tokens": result.output_tokens}),
        )
        for name, start, end, usage in phases:
            attributes: dict[str, str | int] = {**usage, "gen_ai.request.model": self.engine.model_id}
            span = self.tracer.start_span(name, context=inside, start_time=start, attributes=attributes)
            span.end(end_time=end)
        generate.end(end_time=finished_ns)
        return result, submitted
