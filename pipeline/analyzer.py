"""One document -> one validated analysis, in three moves:

1. screen: instruction-like sentences are withheld from the model and flagged (`prompts.injection`);
2. label: polarity, doubt, expectation and, for complaints, category and urgency are one-word
   questions whose allowed answers the engine scores with the model's own probabilities
   (`AnalysisEngine.score`); polarity's side is read from the model's hidden state by a probe
   where the model has one (`pipeline.probe`), else asked and calibrated; neutral is decided by
   its own question (the decision: `pipeline.labels`); the safety floor and the escalation rule
   apply (`pipeline.triage`);
3. write: the narrative (viewpoint, key information, rationale for the decided polarity) is
   generated under its JSON Schema, cleaned by the hygiene rules, repaired once if need be.

Owns the analysis spans (`analyze`, with `label`, `queue_wait` and `generate` children carrying
`gen_ai.*` attributes). Talks to the engine only through `AnalysisEngine`, so a stand-in engine can
serve delivery tests.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from opentelemetry import trace

from engine import EngineError, EngineOptions, EngineStats, GenerationResult, SamplingParams
from pipeline.codec import Document
from pipeline.labels import LabelPolicy, Labels, Scored, decide
from pipeline.probe import PolarityProbe, ProbeError, guarded, mean_log_odds, parts
from pipeline.progress import PartialNarrative, Progress
from pipeline.telemetry import record_generation
from pipeline.triage import triage_of
from prompts import (
    AnalysisParseError,
    Prompt,
    Question,
    parse_narrative,
    questions,
    render,
    render_repair,
    screen,
)
from prompts.render import CONTENT_FREE, POLARITY_QUESTIONS
from schemas import (
    BUILT_IN_KINDS,
    Analysis,
    Category,
    DeadLetterReason,
    DocumentKind,
    KindSpec,
    Language,
    Narrative,
    Sentiment,
    Triage,
    narrative_json_schema,
)

Messages = Sequence[dict[str, str]]
OnText = Callable[[str], None]


class AnalysisEngine(Protocol):
    """What the analyser needs of a model: chat messages in, a generation or the log-probabilities
    of allowed answers out. `pipeline.backends` adapts the embedded engine (the default) and any
    OpenAI-compatible server (`ANALYZER_BACKEND=openai`)."""

    @property
    def model_id(self) -> str: ...

    @property
    def provider(self) -> str: ...  # gen_ai.provider.name

    @property
    def config(self) -> EngineOptions: ...

    async def prepare(self, json_schema: str) -> None: ...

    async def generate(
        self, messages: Messages, params: SamplingParams | None = None, on_text: OnText | None = None
    ) -> GenerationResult: ...  # `on_text`: each piece of text as it is generated

    async def score(self, messages: Messages, continuations: Sequence[str]) -> list[float]: ...

    async def hidden(self, messages: Messages, depth: int) -> Sequence[float]: ...  # a probe's input

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
    tpot_s: float | None  # decode seconds per token after the first, first attempt; None: one token


class AnalysisFailed(Exception):
    """No valid analysis: the dead-letter reason, the last raw output (if any), attempts made."""

    def __init__(self, reason: DeadLetterReason, message: str, raw_output: str | None, attempts: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.raw_output = raw_output
        self.attempts = attempts


class Analyzer:
    def __init__(
        self,
        engine: AnalysisEngine,
        tracer: trace.Tracer,
        *,
        max_new_tokens: int,
        attempts: int,
        policy: LabelPolicy | None = None,
        kinds: Mapping[str, KindSpec] = BUILT_IN_KINDS,
    ) -> None:
        self.engine = engine
        self.policy = policy or LabelPolicy()
        self.tracer = tracer
        self.kinds = kinds
        # Per (kind, language): the narrative's sampling, under its JSON Schema (the kind's own
        # fields make it differ by kind).
        self.params = {
            (name, language): SamplingParams(
                max_new_tokens=max_new_tokens,
                json_schema=json.dumps(narrative_json_schema(language, spec.fields)),
            )
            for name, spec in kinds.items()
            for language in Language
        }
        self.attempts = attempts
        # Per (language, question): the option probabilities on content-free inputs. A question's
        # prompt is the same for every kind (complaints only ask more), so kinds share them.
        self._priors: dict[tuple[Language, str], asyncio.Future[list[float]]] = {}

    async def prepare(self) -> None:
        """Compiles each distinct grammar (kind x language) and measures the calibration priors
        ahead of the first documents, one at a time (a grammar takes seconds; a document whose
        grammar is not ready yet waits for it)."""
        for schema in dict.fromkeys(p.json_schema for p in self.params.values()):
            if schema is not None:
                await self.engine.prepare(schema)
        for language in Language:
            # The questions of a triaged kind: every question there is (their prompts do not
            # depend on the kind, so neither do their priors).
            every = questions(BUILT_IN_KINDS[DocumentKind.COMPLAINT], language, "")
            for question in self._asked(every).values():
                if question.calibrate:
                    await self._prior(language, question.name)
            if (probe := self.policy.probe) is not None:  # refused now, not at the first document
                if not probe.covers(language.value):
                    raise ProbeError(
                        f"the polarity probe of {probe.model} has no weights for {language.value}"
                    )
                polarity = next(q for q in every if q.name == "polarity")
                probe.check(len(await self.engine.hidden(polarity.prompt.messages, probe.depth)))

    async def _prior(self, language: Language, name: str) -> list[float]:
        key = (language, name)
        if key not in self._priors:
            future = self._priors[key] = asyncio.get_running_loop().create_future()
            try:
                future.set_result(await self._measure_prior(language, name))
            except BaseException as exc:
                del self._priors[key]
                future.set_exception(exc)
                raise
        return await asyncio.shield(self._priors[key])

    async def _measure_prior(self, language: Language, name: str) -> list[float]:
        """The policy's fixed prior for the question, else its option probabilities averaged over
        the content-free inputs."""
        asked = [
            next(
                q for q in questions(BUILT_IN_KINDS[DocumentKind.COMPLAINT], language, text) if q.name == name
            )
            for text in CONTENT_FREE
        ]
        if (fixed := self.policy.fixed_prior(language.value, asked[0])) is not None:
            return fixed
        rows = [await self._score(question) for question in asked]
        return [sum(math.exp(r[i]) for r in rows) / len(rows) for i in range(len(rows[0]))]

    async def _score(self, question: Question) -> list[float]:
        try:
            return await self.engine.score(question.prompt.messages, question.options)
        except EngineError as exc:
            raise AnalysisFailed(DeadLetterReason.GENERATION_FAILED, str(exc), None, 1) from exc

    async def scores(self, kind: str, language: Language, text: str) -> Scored:
        """Every labelling question of a (screened) document scored, and the probe's reading where
        the policy has one. The first request reads the polarity prompt (the probe's, else the
        first question's); the others find its blocks in the engine's prefix cache."""
        every = questions(self.kinds[kind], language, text)
        asked = self._asked(every)
        names = list(asked)
        if (probe := self.policy.probe) is not None:
            whole = next(q for q in every if q.name == "polarity")
            reading: float | None = await self._read(probe, whole, kind, language, text)
            scores = await asyncio.gather(*(self._score(asked[n]) for n in names))
        else:
            reading = None
            first = await self._score(asked[names[0]])
            scores = [first, *await asyncio.gather(*(self._score(asked[n]) for n in names[1:]))]
        priors = {n: await self._prior(language, n) for n, q in asked.items() if q.calibrate}
        return Scored(asked, dict(zip(names, scores, strict=True)), priors, reading)

    async def reading(self, kind: str, language: Language, text: str) -> float:
        """The probe's reading of a (screened) document read as `kind` (a triaged kind's checked in
        parts), without the other questions."""
        whole = next(q for q in questions(self.kinds[kind], language, text) if q.name == "polarity")
        return await self._read(self._probe(), whole, kind, language, text)

    async def checked(self, kind: str, language: Language, text: str, reading: float) -> float:
        """`reading` (the probe's, of the screened `text`) as a triaged kind's is decided: where it
        is positive, checked against the text's parts read apart (`LabelPolicy.guard_parts`,
        `guard_below`; `pipeline.probe.guarded`). What `bench.quality` reports for real documents
        read as complaints, from the readings it already has."""
        pieces = parts(text, self.policy.guard_parts)
        if reading <= 0 or len(pieces) <= 1:
            return reading
        return guarded(
            reading, await self._apart(self._probe(), kind, language, pieces), self.policy.guard_below
        )

    def _probe(self) -> PolarityProbe:
        if (probe := self.policy.probe) is None:
            raise ValueError("the label policy has no probe to read with")
        return probe

    async def _read(
        self, probe: PolarityProbe, whole: Question, kind: str, language: Language, text: str
    ) -> float:
        """The probe's log-odds of positive for the document (`whole`: its polarity question), or
        the length-weighted mean of its parts' (`LabelPolicy.polarity_parts`); for a triaged kind,
        `checked` in parts."""
        pieces = parts(text, self.policy.polarity_parts)
        if len(pieces) <= 1:  # no part to read apart: the question already rendered
            reading = probe.logit(language.value, await self._hidden(whole, probe.depth))
        else:
            readings = await self._apart(probe, kind, language, pieces)
            reading = mean_log_odds([(r, len(p)) for r, p in zip(readings, pieces, strict=True)])
        return await self.checked(kind, language, text, reading) if self.kinds[kind].triage else reading

    async def _apart(
        self, probe: PolarityProbe, kind: str, language: Language, pieces: Sequence[str]
    ) -> list[float]:
        """The probe's reading of each of `pieces`, each in a polarity question of its own."""
        asked = [
            next(q for q in questions(self.kinds[kind], language, p) if q.name == "polarity") for p in pieces
        ]
        states = await asyncio.gather(*(self._hidden(q, probe.depth) for q in asked))
        return [probe.logit(language.value, state) for state in states]

    async def _hidden(self, question: Question, depth: int) -> Sequence[float]:
        try:
            return await self.engine.hidden(question.prompt.messages, depth)
        except EngineError as exc:
            raise AnalysisFailed(DeadLetterReason.GENERATION_FAILED, str(exc), None, 1) from exc

    def _asked(self, every: Sequence[Question]) -> dict[str, Question]:
        """Of a document's questions, those the policy uses (the polarity question, when asked, first)."""
        unused = set(POLARITY_QUESTIONS) - set(self.policy.polarity_questions)
        if self.policy.urgency_from == "rules":
            unused.add("urgency")
        return {q.name: q for q in every if q.name not in unused}

    async def label(self, kind: str, language: Language, text: str) -> Labels:
        """The labels of a (screened) document."""
        return decide(await self.scores(kind, language, text), self.policy)

    async def analyze(
        self, document: Document, consumed_at: float, progress: Progress | None = None
    ) -> AnalysisOutcome:
        """The document's analysis; `progress`, when given, sees it as it is written."""
        screened = screen(document.text, document.language)
        prompt_tokens = output_tokens = batch_size = 0
        first: tuple[float, float] | None = None
        tpot: float | None = None
        raw: str | None = None
        with self.tracer.start_as_current_span("analyze") as span:
            span.set_attributes(
                {
                    "deepanalyze.document.kind": document.kind,
                    "deepanalyze.document.language": document.language.value,
                    "deepanalyze.document.chars": len(document.text),
                    "deepanalyze.suspected_injection": screened.suspected,
                }
            )
            with self.tracer.start_as_current_span("label") as label_span:
                labels = await self.label(document.kind, document.language, screened.labelled)
                label_span.set_attributes(
                    {
                        "deepanalyze.polarity": labels.polarity.value,
                        "deepanalyze.polarity.confidence": labels.confidence,
                    }
                )
            kind = self.kinds[document.kind]
            triage = self.triage_of(document, kind, labels)
            decided = {
                "sentiment": {"polarity": labels.polarity.value, "implies_doubt": labels.doubt,
                              "implies_expectation": labels.expectation, "confidence": labels.confidence},
                "triage": None if triage is None else triage.model_dump(mode="json"),
            }  # fmt: skip
            if progress is not None:
                progress(decided)
            prompt = render(kind, document.language, screened.text, labels.polarity)
            for attempt in range(1, self.attempts + 1):
                written = None if progress is None else PartialNarrative(decided, progress)
                params = self.params[kind.name, document.language]
                result, submitted = await self._generate(prompt, params, attempt, written)
                prompt_tokens += result.prompt_tokens
                output_tokens += result.output_tokens
                batch_size = max(batch_size, result.batch_size)
                if first is None:
                    lag = submitted - consumed_at
                    first = (lag + result.queued_s, lag + result.ttft_s)
                    if result.output_tokens > 1:
                        tpot = (result.total_s - result.ttft_s) / (result.output_tokens - 1)
                raw = result.text
                try:
                    narrative = parse_narrative(raw, document.language, screened.text, kind.fields)
                except AnalysisParseError as exc:
                    span.add_event("invalid_output", {"attempt": attempt, "error": str(exc)[:500]})
                    if attempt == self.attempts:
                        span.set_attribute("deepanalyze.attempts", attempt)
                        raise AnalysisFailed(
                            DeadLetterReason.MODEL_OUTPUT_INVALID, str(exc), raw, attempt
                        ) from exc
                    prompt = render_repair(prompt, raw, str(exc))
                    continue
                span.set_attribute("deepanalyze.attempts", attempt)
                analysis = self.assemble(narrative, labels, triage, screened.excerpts)
                return AnalysisOutcome(
                    analysis, attempt, prompt_tokens, output_tokens, *first, batch_size, tpot
                )
        raise AssertionError("unreachable: attempts >= 1")  # pragma: no cover

    @staticmethod
    def triage_of(document: Document, kind: KindSpec, labels: Labels) -> Triage | None:
        """For a triaged kind (complaints) the triage: the model's queue, urgency by the rule (or
        the model's) and the safety floor over the whole text; None for the others."""
        if not kind.triage:
            return None
        return triage_of(
            document.text,
            document.language,
            labels.category or Category.OTHER,
            labels.urgency,
            labels.category_shares,
        )

    @staticmethod
    def assemble(
        narrative: Narrative, labels: Labels, triage: Triage | None, excerpts: Sequence[str]
    ) -> Analysis:
        """The analysis: the model's narrative, the labels and the triage."""
        return Analysis(
            core_viewpoint=narrative.core_viewpoint,
            key_information=narrative.key_information,
            sentiment=Sentiment(
                polarity=labels.polarity,
                implies_doubt=labels.doubt,
                implies_expectation=labels.expectation,
                rationale=narrative.rationale,
                confidence=labels.confidence,
            ),
            triage=triage,
            fields=narrative.fields,
            suspected_injection=bool(excerpts),
            injection_excerpts=list(excerpts[:8]),
        )

    async def _generate(
        self, prompt: Prompt, params: SamplingParams, attempt: int, written: PartialNarrative | None = None
    ) -> tuple[GenerationResult, float]:
        """The result and when it was submitted (perf_counter)."""
        submitted = time.perf_counter()
        submitted_ns = time.time_ns()
        try:
            result = await self.engine.generate(
                prompt.messages, params, None if written is None else written.feed
            )
        except EngineError as exc:
            raise AnalysisFailed(DeadLetterReason.GENERATION_FAILED, str(exc), None, attempt) from exc
        record_generation(
            self.tracer,
            self.engine.provider,
            self.engine.model_id,
            submitted_ns,
            result,
            attempt,
            params.max_new_tokens,
        )
        return result, submitted
