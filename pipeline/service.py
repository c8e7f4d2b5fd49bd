"""The consume -> analyse -> publish -> commit loop.

Each consumed record ends as exactly one analysis event or one dead letter, published with
acks=all; only then is it marked done in the `OffsetTracker`, and only contiguous done offsets
are committed. Bad input never stops the loop; a publish that keeps failing does (the record
stays uncommitted and is re-delivered after restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import ConsumerRecord, TopicPartition
from opentelemetry import trace
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from pipeline.analyzer import AnalysisEngine, AnalysisFailed, Analyzer
from pipeline.codec import Document, RecordError, dead_letter, decode_document
from pipeline.kafka import ensure_topics, make_consumer, make_producer, wait_for_broker
from pipeline.offsets import OffsetTracker
from pipeline.settings import Settings
from pipeline.telemetry import Telemetry, current_trace_id, extract_context
from schemas import AnalysisEvent, DeadLetter, DeadLetterReason, EngineSettings, Timings

log = logging.getLogger(__name__)

JSON_HEADERS = [("content-type", b"application/json")]


class PublishError(RuntimeError):
    """An answer could not be delivered after retries; the service stops without committing it."""


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

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info("assigned %s", sorted(f"{tp.topic}[{tp.partition}]" for tp in assigned))


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
        self.counters = Counters()
        self.started_at = time.time()
        self.is_ready = False
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._fatal: BaseException | None = None

    @property
    def engine_settings(self) -> EngineSettings:
        return EngineSettings(
            dynamic_batching=self.settings.dynamic_batching,
            kv_compression=self.settings.kv_compression,
            max_batch_size=self.settings.max_batch_size,
        )

    def status(self) -> dict[str, Any]:
        stats = self.engine.stats()
        return {
            "status": "ready" if self.is_ready else "starting",
            "dynamic_batching": self.settings.dynamic_batching,
            "kv_compression": stats.kv_compression,
            "kv_profile": {
                "quant_bits": stats.kv_quant_bits,
                "residual_tokens": self.settings.kv_residual_tokens,
                "sink_tokens": self.settings.kv_sink_tokens,
                "keep_ratio": self.settings.kv_keep_ratio,
                "prune_policy": self.settings.kv_prune_policy,
            }
            if stats.kv_compression
            else None,
            "max_batch_size": self.settings.max_batch_size,
            "dynamic_batch_window_ms": self.settings.dynamic_batch_window_ms,
            "model": stats.model_id,
            "device": stats.device,
            "dtype": stats.dtype,
            "consumed": self.counters.consumed,
            "processed": self.counters.processed,
            "failed": self.counters.failed,
            "dead_lettered": self.counters.dead_lettered,
            "in_flight": len(self._tasks),
            "engine": {
                "waiting": stats.num_waiting,
                "running": stats.num_running,
                "steps": stats.num_steps,
                "mean_batch_size": round(stats.mean_batch_size, 3),
                "largest_batch": stats.largest_batch,
                "batch_occupancy": round(stats.batch_occupancy, 3),
                "generated_tokens": stats.num_generated_tokens,
                "preemptions": stats.num_preemptions,
            },
            "kv_pool": {
                "total_bytes": stats.kv_total_bytes,
                "used_bytes": stats.kv_used_bytes,
                "free_bytes": stats.kv_total_bytes - stats.kv_used_bytes,
                "bytes_per_token": stats.kv_bytes_per_token,
                "quantised_bytes_per_token": stats.kv_cold_bytes_per_token,
                "held_tokens": stats.kv_tokens,
                "live_ratio": round(stats.kv_ratio, 4),
                "prefix_caching": stats.prefix_caching,
                "prefix_cached_blocks": stats.prefix_cached_blocks,
                "prefix_hit_tokens": stats.prefix_hit_tokens,
            },
            "input_topics": list(self.settings.input_topics),
            "consumer_group": self.settings.consumer_group,
            "uptime_s": round(time.time() - self.started_at, 1),
        }

    async def run(self, stop: asyncio.Event) -> None:
        """Consumes until `stop` is set, then drains in-flight work, commits and closes."""
        await wait_for_broker(self.settings)
        await ensure_topics(self.settings)
        self._producer = make_producer(self.settings)
        self._consumer = make_consumer(self.settings)
        await self._producer.start()
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
            await self._producer.stop()
        if self._fatal is not None:
            raise self._fatal

    async def _consume(self, stop: asyncio.Event) -> None:
        if self._consumer is None:
            raise RuntimeError("consume before start")
        last_commit = time.monotonic()
        while not stop.is_set() and self._fatal is None:
            room = self.settings.max_inflight - len(self._tasks)
            if room <= 0:
                await asyncio.wait(self._tasks, timeout=0.2, return_when=asyncio.FIRST_COMPLETED)
            else:
                batch = await self._consumer.getmany(timeout_ms=200, max_records=room)
                for tp, records in batch.items():
                    for record in records:
                        self._spawn(tp, record)
            if time.monotonic() - last_commit >= self.settings.commit_interval_ms / 1000:
                await self.commit()
                last_commit = time.monotonic()

    def _spawn(self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes]) -> None:
        self.counters.consumed += 1
        self.tracker.register(tp, record.offset)
        task = asyncio.create_task(self._handle(tp, record, time.perf_counter()))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        if self._tasks:
            log.info("waiting for %d in-flight documents", len(self._tasks))
            await asyncio.gather(*self._tasks, return_exceptions=True)

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
        self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes], consumed_at: float
    ) -> None:
        attributes = {
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": record.topic,
            "messaging.destination.partition.id": str(record.partition),
            "messaging.consumer.group.name": self.settings.consumer_group,
            "messaging.kafka.offset": record.offset,
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
            return dead_letter(**coords, reason=exc.reason, message=str(exc), trace_id=current_trace_id())
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
            )

    async def _analyze(self, document: Document, consumed_at: float) -> AnalysisEvent:
        outcome = await self.analyzer.analyze(document, consumed_at)
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
        if self._producer is None:
            raise RuntimeError("publish before start")
        if isinstance(answer, AnalysisEvent):
            topic, key = self.settings.topic_analysis, answer.document_id
        else:
            topic, key = self.settings.topic_dead_letters, answer.document_id or answer.event_id
        value = answer.model_dump_json().encode("utf-8")
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(KafkaError),
                wait=wait_exponential(multiplier=0.2, max=5),
                stop=stop_after_attempt(5),
                reraise=True,
            ):
                with attempt:
                    await self._producer.send_and_wait(
                        topic, value, key=key.encode("utf-8"), headers=list(JSON_HEADERS)
                    )
        except KafkaError as exc:
            raise PublishError(f"could not publish {answer.event_id} to {topic}: {exc}") from exc
        if isinstance(answer, AnalysisEvent):
            self.counters.processed += 1
        else:
            self.counters.dead_lettered += 1


@contextlib.asynccontextmanager
async def running(service: Service, stop: asyncio.Event) -> Any:
    """Runs `service` in the background for the body of the block (tests, demo)."""
    task = asyncio.create_task(service.run(stop))
    try:
        yield task
    finally:
        stop.set()
        await task
