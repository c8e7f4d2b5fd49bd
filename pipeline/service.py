"""The consume -> analyse -> publish -> commit loop.

Each consumed record ends as exactly one analysis event or one dead letter, published with
acks=all; only then is it marked done in the `OffsetTracker`, and only contiguous done offsets
are committed. Bad input never stops the loop; a publish that keeps failing does (the record
stays uncommitted and is re-delivered after restart).

Backpressure: at most `MAX_INFLIGHT` documents are between consume and answer; while that many
are, fetching from every assigned partition is paused (nothing piles up in the client either).
Shutdown: stop fetching, give in-flight documents `SHUTDOWN_GRACE_S` to finish, abandon the rest
(uncommitted, so re-delivered to whoever owns the partition next), commit, return.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import ConsumerRecord, TopicPartition
from opentelemetry import trace

from pipeline.analyzer import AnalysisEngine, AnalysisFailed, Analyzer
from pipeline.codec import Document, RecordError, dead_letter, decode_document
from pipeline.kafka import ensure_topics, make_consumer, make_producer, wait_for_broker
from pipeline.metrics import Metrics, Snapshot
from pipeline.offsets import OffsetTracker
from pipeline.publish import Publisher, PublishError
from pipeline.settings import Settings
from pipeline.status import status_report
from pipeline.telemetry import Telemetry, current_trace_id, extract_context
from schemas import AnalysisEvent, DeadLetter, DeadLetterReason, EngineSettings, Timings

log = logging.getLogger(__name__)


@dataclass
class Counters:
    consumed: int = 0
    processed: int = 0  # analysis events published
    failed: int = 0  # analyses that ended as dead letters
    dead_lettered: int = 0  # every dead letter, malformed input included


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, service: Service) -> None:
        self.service = service

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.service.commit()
        self.service.tracker.forget(set(revoked))
        for tp in revoked:
            self.service.start_offsets.pop(tp, None)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info("assigned %s", sorted(f"{tp.topic}[{tp.partition}]" for tp in assigned))
        consumer = self.service.consumer
        for tp in assigned:  # where the group stood: the lag gauge's baseline until we commit
            try:
                self.service.start_offsets[tp] = await consumer.committed(tp) or 0
            except KafkaError as exc:
                log.warning("committed offset of %s unknown: %s", tp, exc)


class Service:
    def __init__(self, settings: Settings, engine: AnalysisEngine, telemetry: Telemetry) -> None:
        self.settings = settings
        self.engine = engine
        self.telemetry = telemetry
        self.tracer = telemetry.tracer
        self.analyzer = Analyzer(
            engine, self.tracer, max_new_tokens=settings.max_new_tokens, attempts=settings.generation_attempts
        )
        self.tracker = OffsetTracker()
        self.start_offsets: dict[TopicPartition, int] = {}
        self.counters = Counters()
        self.metrics = Metrics(settings.otel_service_name, self.snapshot)
        self.started_at = time.time()
        self.is_ready = False
        self._preparing: asyncio.Task[None] | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._publisher: Publisher | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._fatal: BaseException | None = None
        self._paused = False
        self._committing: asyncio.Task[None] | None = None

    @property
    def consumer(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            raise RuntimeError("the service is not running")
        return self._consumer

    def lag(self) -> dict[TopicPartition, int]:
        """Per assigned partition: the last fetched highwater minus the committed offset."""
        if self._consumer is None:
            return {}
        lags = {}
        for tp in self._consumer.assignment():
            highwater = self._consumer.highwater(tp)
            committed = self.tracker.committed_offset(tp)
            if committed is None:
                committed = self.start_offsets.get(tp, 0)
            if highwater is not None:
                lags[tp] = max(0, highwater - committed)
        return lags

    def snapshot(self) -> Snapshot:
        stats = self.engine.stats()
        return Snapshot(
            queue_depth=stats.num_waiting,
            running=stats.num_running,
            in_flight=self.in_flight,
            kv_used_bytes=stats.kv_used_bytes,
            kv_total_bytes=stats.kv_total_bytes,
            lag={(tp.topic, tp.partition): lag for tp, lag in self.lag().items()},
        )

    @property
    def engine_settings(self) -> EngineSettings:
        return EngineSettings(
            dynamic_batching=self.settings.dynamic_batching,
            kv_compression=self.settings.kv_compression,
            max_batch_size=self.settings.max_batch_size,
        )

    @property
    def in_flight(self) -> int:
        """Documents consumed and not yet answered."""
        return len(self._tasks)

    @property
    def grammars_ready(self) -> bool:
        """Whether every kind x language grammar is compiled (documents no longer wait for one)."""
        task = self._preparing
        return task is not None and task.done() and not task.cancelled() and task.exception() is None

    @property
    def paused(self) -> bool:
        """Whether fetching is paused because `MAX_INFLIGHT` documents are in flight."""
        return self._paused

    def status(self) -> dict[str, Any]:
        return status_report(self)

    async def run(self, stop: asyncio.Event) -> None:
        """Consumes until `stop` is set, then drains in-flight work, commits and closes."""
        await wait_for_broker(self.settings)
        await ensure_topics(self.settings)
        # Everything allocated so far (imports, model, engine) lives as long as the process: out of
        # the collector's sight, a full collection stops rescanning it (90 ms each in a worker with
        # torch loaded, ~200k objects; such pauses were the pipeline's latency tail).
        gc.freeze()
        # Grammars compile in the background while the consumer starts and reads.
        preparing = self._preparing = asyncio.create_task(self.analyzer.prepare(), name="prepare-grammars")
        preparing.add_done_callback(_report_preparation)
        producer = make_producer(self.settings)
        self._consumer = make_consumer(self.settings)
        await producer.start()
        self._publisher = Publisher(producer, self.settings, self.tracer)
        try:
            self._consumer.subscribe(list(self.settings.input_topics), listener=_Rebalance(self))
            await self._consumer.start()
            try:
                self.is_ready = True
                await self._consume(stop)
            finally:
                self.is_ready = False
                await self._drain()
                await self.commit()
                await self._consumer.stop()
        finally:
            preparing.cancel()
            await asyncio.gather(preparing, return_exceptions=True)
            await producer.stop()
        if self._fatal is not None:
            raise self._fatal

    async def _consume(self, stop: asyncio.Event) -> None:
        if self._consumer is None:
            raise RuntimeError("consume before start")
        last_commit = time.monotonic()
        while not stop.is_set() and self._fatal is None:
            room = self.settings.max_inflight - len(self._tasks)
            self._pause(room <= 0)
            if room <= 0:
                await asyncio.wait(self._tasks, timeout=0.2, return_when=asyncio.FIRST_COMPLETED)
            else:
                batch = await self._consumer.getmany(timeout_ms=200, max_records=room)
                fetched = sum(map(len, batch.values()))
                for tp, records in batch.items():
                    for record in records:
                        self._spawn(tp, record, fetched)
            if time.monotonic() - last_commit >= self.settings.commit_interval_ms / 1000:
                # In the background: a commit's round trip must not hold up fetching.
                if self._committing is None or self._committing.done():
                    self._committing = asyncio.create_task(self.commit())
                last_commit = time.monotonic()
        if self._committing is not None:
            await self._committing

    def _pause(self, full: bool) -> None:
        """Pauses fetching from every assigned partition while in-flight work is at its bound."""
        if self._consumer is None:
            return
        if full:  # every time: a rebalance may have assigned partitions since
            self._consumer.pause(*self._consumer.assignment())
        elif self._paused:
            self._consumer.resume(*self._consumer.paused())
        self._paused = full

    def _spawn(self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes], fetched: int) -> None:
        self.counters.consumed += 1
        self.tracker.register(tp, record.offset)
        task = asyncio.create_task(self._handle(tp, record, time.perf_counter(), fetched))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        if not self._tasks:
            return
        grace = self.settings.shutdown_grace_s
        log.info("waiting up to %.0f s for %d in-flight documents", grace, len(self._tasks))
        _, pending = await asyncio.wait(self._tasks, timeout=grace)
        if pending:
            log.warning(
                "abandoning %d unfinished documents (not committed: they are re-delivered)", len(pending)
            )
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def commit(self) -> None:
        offsets = self.tracker.to_commit()
        if not offsets or self._consumer is None:
            return
        try:
            await self._consumer.commit(offsets)
        except (CommitFailedError, KafkaError) as exc:
            # A rebalance took the partition away; the new owner re-delivers what we did not commit.
            log.warning("commit of %d partitions failed: %s", len(offsets), exc)
            return
        self.tracker.committed(offsets)

    # -- one record ---------------------------------------------------------------------------

    async def _handle(
        self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes], consumed_at: float, fetched: int
    ) -> None:
        attributes = {
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": record.topic,
            "messaging.destination.partition.id": str(record.partition),
            "messaging.consumer.group.name": self.settings.consumer_group,
            "messaging.kafka.offset": record.offset,
            "messaging.batch.message_count": fetched,  # records in the poll that brought it
            "messaging.message.body.size": len(record.value or b""),
        }
        with self.tracer.start_as_current_span(
            f"process {record.topic}",
            context=extract_context(record.headers),
            kind=trace.SpanKind.CONSUMER,
            attributes=attributes,
        ) as span:
            try:
                answer = await self._answer(record, consumed_at)
                await self._publish(answer)
            except PublishError as exc:
                span.record_exception(exc)
                span.set_status(trace.StatusCode.ERROR, str(exc))
                self._fatal = exc
                return
            if isinstance(answer, DeadLetter):
                span.set_attribute("deepanalyze.dead_letter.reason", answer.error_type.value)
                self.metrics.dead_letters.add(1, {"reason": answer.error_type.value})
        outcome = "analysis" if isinstance(answer, AnalysisEvent) else "dead_letter"
        self.metrics.documents.add(1, {"outcome": outcome})
        self.metrics.duration.record(time.perf_counter() - consumed_at, {"outcome": outcome})
        self.tracker.mark_done(tp, record.offset)

    async def _answer(
        self, record: ConsumerRecord[bytes, bytes], consumed_at: float
    ) -> AnalysisEvent | DeadLetter:
        coords = {
            "topic": record.topic,
            "partition": record.partition,
            "offset": record.offset,
            "key": record.key,
            "value": record.value,
            "headers": record.headers,
        }
        try:
            document = decode_document(
                **coords,
                default_kind=self.settings.input_topics[record.topic],
                max_chars=self.settings.max_document_chars,
            )
        except RecordError as exc:
            log.info(
                "dead letter %s[%d]@%d: %s", record.topic, record.partition, record.offset, exc.reason.value
            )
            return dead_letter(
                **coords,
                reason=exc.reason,
                message=str(exc),
                trace_id=current_trace_id(),
                max_value_bytes=self.settings.dead_letter_max_value_bytes,
            )
        try:
            return await self._analyze(document, consumed_at)
        except AnalysisFailed as exc:
            self.counters.failed += 1
            return dead_letter(
                **coords,
                reason=exc.reason,
                message=str(exc),
                attempts=exc.attempts,
                document_id=document.document_id,
                raw_model_output=exc.raw_output,
                trace_id=current_trace_id(),
                max_value_bytes=self.settings.dead_letter_max_value_bytes,
            )
        except Exception as exc:  # a bug must not stop the loop: the record still gets its answer
            log.exception("analysis of %s failed unexpectedly", document.document_id)
            self.counters.failed += 1
            return dead_letter(
                **coords,
                reason=DeadLetterReason.GENERATION_FAILED,
                message=f"{type(exc).__name__}: {exc}",
                document_id=document.document_id,
                trace_id=current_trace_id(),
                max_value_bytes=self.settings.dead_letter_max_value_bytes,
            )

    async def _analyze(self, document: Document, consumed_at: float) -> AnalysisEvent:
        outcome = await self.analyzer.analyze(document, consumed_at)
        self.metrics.ttft.record(outcome.ttft_s, {"kind": document.kind.value})
        self.metrics.batch_size.record(outcome.batch_size)
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

    async def _publish(self, answer: AnalysisEvent | DeadLetter) -> None:
        if self._publisher is None:
            raise RuntimeError("publish before start")
        await self._publisher.publish(answer)
        if isinstance(answer, AnalysisEvent):
            self.counters.processed += 1
        else:
            self.counters.dead_lettered += 1


def _report_preparation(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("grammars could not be prepared (documents needing them will fail): %s", exc)


@contextlib.asynccontextmanager
async def running(service: Service, stop: asyncio.Event) -> Any:
    """Runs `service` in the background for the body of the block (tests, demo)."""
    task = asyncio.create_task(service.run(stop))
    try:
        yield task
    finally:
        stop.set()
        await task
