"""One consumed record -> its answer: the analysis event, or a dead letter with the reason.

`Answerer.answer` never raises for anything a record holds or anything that goes wrong with it
(cancellation aside): a record that cannot be decoded is a dead letter with the codec's reason; a
failed analysis one with the analyser's; any other failure, of decoding, rendering or analysing,
one with `internal_error` (a bug to report), and the loop goes on. Dead letters are built within
`MAX_MESSAGE_BYTES` (`codec.dead_letter`). Does not publish, retry or commit: the service does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pipeline.analyzer import AnalysisEngine, AnalysisFailed, Analyzer
from pipeline.codec import Document, RawRecord, RecordError, dead_letter, decode_document
from pipeline.fetch import Unreadable
from pipeline.metrics import Metrics
from pipeline.progress import Progress
from pipeline.settings import Settings
from pipeline.telemetry import current_trace_id
from schemas import PROGRESS_HEADER, AnalysisEvent, DeadLetter, DeadLetterReason, EngineSettings, Timings

log = logging.getLogger(__name__)

Refusal = tuple[DeadLetterReason, str]  # why a record gets a dead letter before any analysis
# Where the analyses written so far go: (the document, its progress so far, the count so far).
ProgressSink = Callable[[Document, dict[str, Any], int], None]


@dataclass
class Counters:
    consumed: int = 0
    processed: int = 0  # analysis events published
    failed: int = 0  # analyses that ended as dead letters
    dead_lettered: int = 0  # every dead letter, malformed input included


class Answerer:
    def __init__(
        self,
        settings: Settings,
        engine: AnalysisEngine,
        analyzer: Analyzer,
        metrics: Metrics,
        counters: Counters,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.analyzer = analyzer
        self.metrics = metrics
        self.counters = counters
        self.progress: ProgressSink | None = None  # set by the service once its producer runs
        self.engine_settings = EngineSettings(  # what the engine runs, as events report it
            dynamic_batching=engine.config.dynamic_batching,
            kv_compression=engine.config.kv_compression,
            max_batch_size=engine.config.max_batch_size,
        )

    def dead_letter(
        self,
        raw: RawRecord,
        reason: DeadLetterReason,
        message: str,
        *,
        keep_value: bool = True,
        **details: Any,
    ) -> DeadLetter:
        return dead_letter(
            raw,
            reason=reason,
            message=message,
            trace_id=current_trace_id(),
            max_value_bytes=self.settings.dead_letter_max_value_bytes if keep_value else 0,
            max_message_bytes=self.settings.max_message_bytes,
            **details,
        )

    def read(self, record: Any) -> tuple[RawRecord, Refusal | None]:
        """A fetched record (or an `Unreadable` in its place) as coordinates and bytes; and, when
        it cannot be analysed whatever it holds, the reason. Never raises."""
        bare = RawRecord(record.topic, record.partition, record.offset, None, None, None)
        if isinstance(record, Unreadable):
            return bare, (
                DeadLetterReason.UNREADABLE_RECORD,
                f"the Kafka client cannot parse it: {record.error}",
            )
        try:
            return RawRecord.of(record), None
        except Exception as exc:  # a record our reading of breaks is still answered
            log.exception(
                "reading %s[%d]@%d failed unexpectedly", record.topic, record.partition, record.offset
            )
            return bare, (DeadLetterReason.INTERNAL_ERROR, f"reading the record failed: {brief(exc)}")

    async def answer(
        self, raw: RawRecord, consumed_at: float, refusal: Refusal | None = None
    ) -> AnalysisEvent | DeadLetter:
        """The record's analysis, or its dead letter; never raises (but for cancellation)."""
        if refusal is not None:
            return self.dead_letter(raw, *refusal)
        where = f"{raw.topic}[{raw.partition}]@{raw.offset}"
        try:
            document = decode_document(
                raw,
                default_kind=self.settings.input_topics[raw.topic],
                max_chars=self.settings.max_document_chars,
                kinds=self.settings.kinds,
            )
        except RecordError as exc:
            log.info("dead letter %s: %s", where, exc.reason.value)
            return self.dead_letter(raw, exc.reason, str(exc))
        except Exception as exc:  # a record that breaks the decoder is still answered
            log.exception("decoding %s failed unexpectedly", where)
            return self.dead_letter(raw, DeadLetterReason.INTERNAL_ERROR, f"decoding failed: {brief(exc)}")
        wanted = self.progress is not None and any(k == PROGRESS_HEADER for k, _ in raw.headers or ())
        try:
            return await self._analyze(document, consumed_at, self._progress_of(document) if wanted else None)
        except AnalysisFailed as exc:
            self.counters.failed += 1
            return self.dead_letter(
                raw,
                exc.reason,
                str(exc),
                attempts=exc.attempts,
                document_id=document.document_id,
                raw_model_output=exc.raw_output,
            )
        except Exception as exc:  # a bug must not stop the loop: the record still gets its answer
            log.exception("analysis of %s failed unexpectedly", where)
            self.counters.failed += 1
            return self.dead_letter(
                raw, DeadLetterReason.INTERNAL_ERROR, brief(exc), document_id=document.document_id
            )

    def _progress_of(self, document: Document) -> Progress:
        sink, count = self.progress, 0

        def progress(written: dict[str, Any]) -> None:
            nonlocal count
            count += 1
            if sink is not None:
                sink(document, written, count)

        return progress

    async def _analyze(
        self, document: Document, consumed_at: float, progress: Progress | None = None
    ) -> AnalysisEvent:
        outcome = await self.analyzer.analyze(document, consumed_at, progress)
        self.metrics.ttft.record(outcome.ttft_s, {"kind": document.kind})
        self.metrics.batch_size.record(outcome.batch_size)
        if outcome.tpot_s is not None:
            self.metrics.tpot.record(outcome.tpot_s, {"kind": document.kind})
        self.metrics.tokens.add(outcome.prompt_tokens, {"type": "input"})
        self.metrics.tokens.add(outcome.output_tokens, {"type": "output"})
        return AnalysisEvent(
            event_id=document.event_id,
            document_id=document.document_id,
            kind=document.kind,
            language=document.language,
            analysis=outcome.analysis,
            model=self.engine.model_id,
            timings=Timings(
                queued_ms=round(outcome.queued_s * 1000, 1),
                time_to_first_token_ms=round(outcome.ttft_s * 1000, 1),
                total_ms=round((time.perf_counter() - consumed_at) * 1000, 1),
                prompt_tokens=outcome.prompt_tokens,
                output_tokens=outcome.output_tokens,
                attempts=outcome.attempts,
            ),
            engine=self.engine_settings,
            source=document.source,
            trace_id=current_trace_id(),
            created_at=datetime.now(UTC),
        )


def brief(exc: BaseException) -> str:
    """An exception as one bounded line: its type and message."""
    return f"{type(exc).__name__}: {exc}"[:500]
