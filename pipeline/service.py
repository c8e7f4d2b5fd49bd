"""The consume -> analyse -> publish -> commit loop.

Each consumed record ends as exactly one analysis event or one dead letter, published with
acks=all; only then is it marked done in the `OffsetTracker`, and only contiguous done offsets
are committed. Whatever a record holds, nothing about it stops the loop: `Answerer` turns any
failure decoding, analysing or rendering it into its dead letter (`internal_error` when no other
reason fits), a record the Kafka client cannot parse becomes an `unreadable_record` dead letter
(`Fetcher`), and an answer the broker refuses (too large) is replaced by a small dead letter.
Only a broker that keeps failing stops the service (the record stays uncommitted and is
re-delivered after restart).

Backpressure: at most `MAX_INFLIGHT` documents are between consume and answer; while that many
are, fetching from every assigned partition is paused (nothing piles up in the client either).
Shutdown: stop fetching, give in-flight documents `SHUTDOWN_GRACE_S` to finish, abandon the rest
(uncommitted, so re-delivered to whoever owns the partition next), commit, return; committing
and closing get `SHUTDOWN_CLOSE_S`, so a broker that is down cannot hold the process. A stop
during start-up (waiting for the broker) returns at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import ConsumerRecord, TopicPartition
from opentelemetry import trace

from pipeline.analyzer import AnalysisEngine, Analyzer
from pipeline.answering import Answerer, Counters
from pipeline.bundled_models import MODELS
from pipeline.delivery import Delivery
from pipeline.fetch import Fetcher, Unreadable
from pipeline.kafka import ensure_topics, make_answer_producer, make_consumer, wait_for_broker
from pipeline.labels import LabelPolicy
from pipeline.metrics import Metrics, Snapshot
from pipeline.offsets import OffsetTracker
from pipeline.probe import PolarityProbe
from pipeline.publish import ProgressSender, Publisher, PublishError
from pipeline.settings import Settings
from pipeline.status import status_report
from pipeline.telemetry import Telemetry, process_span
from pipeline.transactions import TransactionalOutbox
from pipeline.watch import ClusterWatch
from schemas import AnalysisEvent, DeadLetter

log = logging.getLogger(__name__)


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, service: Service) -> None:
        self.service = service

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.service.commit()
        self.service.tracker.forget(set(revoked))
        for tp in revoked:
            self.service.start_offsets.pop(tp, None)
        if self.service.outbox is not None:
            await self.service.outbox.revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info("assigned %s", sorted(f"{tp.topic}[{tp.partition}]" for tp in assigned))
        if self.service.outbox is not None:  # fences the partitions' previous owners first
            await self.service.outbox.assigned(set(assigned))
        consumer = self.service.consumer
        await self.service.read_reborn_from_start(assigned)
        for tp in assigned:  # where the group stood: the lag gauge's baseline until we commit
            try:
                self.service.start_offsets[tp] = await consumer.committed(tp) or 0
            except KafkaError as exc:
                log.warning("committed offset of %s unknown: %s", tp, exc)


def label_policy(settings: Settings) -> LabelPolicy:
    """The default policy with the bundled model's measured polarity prior (none for MODEL_PATH or
    a server's model: the content-free prior is measured on it), its polarity probe (or
    POLARITY_PROBE's, reading POLARITY_PARTS parts, a complaint's positive reading checked in
    POLARITY_GUARD_PARTS) unless POLARITY_FROM=question, and URGENCY_FROM. A probe decides polarity
    alone: the polarity question is then not asked."""
    bundled = settings.model_path is None and settings.analyzer_backend == "embedded"
    prior = MODELS[settings.model].polarity_prior if bundled else {}
    path = settings.polarity_probe or (MODELS[settings.model].probe_path if bundled else None)
    if settings.polarity_from == "question" or path is None:
        return LabelPolicy(polarity_prior=prior, urgency_from=settings.urgency_from)
    probe = PolarityProbe.read(path)
    return LabelPolicy(
        polarity_prior=prior,
        urgency_from=settings.urgency_from,
        probe=probe,
        polarity_questions=(),
        polarity_parts=settings.polarity_parts,
        guard_parts=settings.polarity_guard_parts,
    )


class Service:
    def __init__(self, settings: Settings, engine: AnalysisEngine, telemetry: Telemetry) -> None:
        self.settings = settings
        self.engine = engine
        self.telemetry = telemetry
        self.tracer = telemetry.tracer
        self.analyzer = Analyzer(
            engine,
            self.tracer,
            max_new_tokens=settings.max_new_tokens,
            attempts=settings.generation_attempts,
            policy=label_policy(settings),
            kinds=settings.kinds,
        )
        self.tracker = OffsetTracker()
        self.start_offsets: dict[TopicPartition, int] = {}
        self.counters = Counters()
        self.metrics = Metrics(settings.otel_service_name, self.snapshot)
        self.answerer = Answerer(settings, engine, self.analyzer, self.metrics, self.counters)
        self.started_at = time.time()
        self.is_ready = False
        self._preparing: asyncio.Task[None] | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._delivery: Delivery | None = None
        self.outbox: TransactionalOutbox | None = None  # PROCESSING_GUARANTEE=exactly_once
        self._tasks: set[asyncio.Task[None]] = set()
        self._fatal: BaseException | None = None
        self._paused = False
        self._committing: asyncio.Task[None] | None = None
        self._close_left_s = settings.shutdown_close_s  # what the shutdown's `_bounded` steps have left
        self._watch: ClusterWatch | None = None
        self._reborn: set[str] = set()  # input topics created anew: read from their start when assigned

    @property
    def consumer(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            raise RuntimeError("the service is not running")
        return self._consumer

    @property
    def watch(self) -> ClusterWatch | None:
        return self._watch

    def lag(self) -> dict[TopicPartition, int]:
        """Per input partition: how many records the group has yet to answer. Assigned partitions
        from this worker's own fetches and commits; the others as the cluster watch last saw them
        (end offset minus the group's commit)."""
        if self._consumer is None:
            return {}
        lags = dict(self._watch.view.lag) if self._watch is not None else {}
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
            generated_tokens=stats.num_generated_tokens,
            prefix_hit_tokens=stats.prefix_hit_tokens,
            preemptions=stats.num_preemptions,
            steps=stats.num_steps,
            accepted_drafts=stats.num_accepted_drafts,
        )

    def broker_reachable(self) -> bool | None:
        """Whether the cluster watch last reached the brokers (None: not looked yet)."""
        return self._watch.view.reachable if self._watch is not None else None

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
        if not await unless_stopped(stop, self._meet_broker()):
            log.info("stopped while waiting for Kafka")
            return
        # Everything allocated so far (imports, model, engine) lives as long as the process: out of
        # the collector's sight, a full collection stops rescanning it (90 ms each in a worker with
        # torch loaded, ~200k objects; such pauses were the pipeline's latency tail).
        gc.freeze()
        # Grammars compile in the background while the consumer starts and reads.
        preparing = self._preparing = asyncio.create_task(self.analyzer.prepare(), name="prepare-grammars")
        preparing.add_done_callback(_report_preparation)
        producer = make_answer_producer(self.settings)
        consumer = self._consumer = make_consumer(self.settings)
        watching: asyncio.Task[None] | None = None
        try:
            if not await unless_stopped(stop, producer.start()):
                return
            if self.settings.processing_guarantee == "exactly_once":
                self.outbox = TransactionalOutbox(self.settings, self.tracer)
            publisher = Publisher(producer, self.settings, self.tracer)
            self.answerer.progress = ProgressSender(producer, self.settings)
            self._delivery = Delivery(self.answerer, self.counters, publisher, self.outbox)
            consumer.subscribe(list(self.settings.input_topics), listener=_Rebalance(self))
            if not await unless_stopped(stop, consumer.start()):
                return
            self._watch = ClusterWatch(self.settings, consumer, self.topics_recreated)
            watching = asyncio.create_task(self._watch.run(stop), name="cluster-watch")
            try:
                self.is_ready = True
                await self._consume(stop, Fetcher(consumer, self.tracker.next_to_read))
            finally:
                self.is_ready = False
                await self._drain()
                await self._close(consumer, watching)
        finally:
            preparing.cancel()
            await asyncio.gather(preparing, return_exceptions=True)
            if self.outbox is not None:
                await self._bounded("closing the transactional producers", self.outbox.close())
            await self._bounded("closing the producer", producer.stop())
        if self._fatal is not None:
            raise self._fatal

    async def topics_recreated(self, topics: list[str]) -> None:
        """Input topics found gone and created again: their offsets start over at 0, so reading
        must too. A consumer keeps its position (and the group may keep its commit) from the old
        topic, and would skip the new records below it, answering none of them."""
        self._reborn |= set(topics) & set(self.settings.input_topics)
        await self.read_reborn_from_start(self.consumer.assignment())

    async def read_reborn_from_start(self, partitions: set[TopicPartition]) -> None:
        reborn = {tp for tp in partitions if tp.topic in self._reborn}
        if not reborn:
            return
        log.warning(
            "reading %s from the start: created anew", sorted(f"{tp.topic}[{tp.partition}]" for tp in reborn)
        )
        self.tracker.forget(reborn)
        await self.consumer.seek_to_beginning(*reborn)
        self._reborn -= {tp.topic for tp in reborn}

    async def _meet_broker(self) -> None:
        await wait_for_broker(self.settings, self.settings.broker_wait_s)
        await ensure_topics(self.settings)

    async def _close(self, consumer: AIOKafkaConsumer, watching: asyncio.Task[None] | None) -> None:
        if watching is not None:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
        await self._bounded("committing", self.commit())
        await self._bounded("leaving the group", consumer.stop())

    async def _bounded(self, what: str, step: Any) -> None:
        """One shutdown step, within what its run has left of SHUTDOWN_CLOSE_S: the steps share it
        (a bound each would add up, past a pod's termination grace), so a broker that is down holds
        the exit for SHUTDOWN_CLOSE_S at most, besides the grace for in-flight documents."""
        started = time.monotonic()
        try:
            await asyncio.wait_for(step, max(0.0, self._close_left_s))
        except TimeoutError:
            log.warning("%s: gave up, SHUTDOWN_CLOSE_S (%.0f s) spent", what, self.settings.shutdown_close_s)
        except KafkaError as exc:
            log.warning("%s failed: %s", what, exc)
        except asyncio.CancelledError:
            # With the broker down, aiokafka's consumer.stop() awaits a fetch task it has just
            # cancelled and lets that CancelledError out; only a cancellation of our own goes on.
            if (task := asyncio.current_task()) is not None and task.cancelling():
                raise
            log.warning("%s was cut short inside the Kafka client", what)
        finally:
            self._close_left_s -= time.monotonic() - started

    async def _consume(self, stop: asyncio.Event, fetcher: Fetcher) -> None:
        last_commit = time.monotonic()
        while not stop.is_set() and self._fatal is None:
            room = self.settings.max_inflight - len(self._tasks)
            self._pause(room <= 0)
            if room <= 0:
                await asyncio.wait(self._tasks, timeout=0.2, return_when=asyncio.FIRST_COMPLETED)
            else:
                fetched = await fetcher.fetch(room)
                for tp, record in fetched:
                    self._spawn(tp, record, len(fetched))
            if time.monotonic() - last_commit >= self.settings.commit_interval_ms / 1000:
                # In the background: a commit's round trip must not hold up fetching.
                if self._committing is None or self._committing.done():
                    self._committing = asyncio.create_task(self.commit())
                last_commit = time.monotonic()
        if self._committing is not None:  # the final commit after the drain supersedes it
            self._committing.cancel()
            await asyncio.gather(self._committing, return_exceptions=True)

    def _pause(self, full: bool) -> None:
        """Pauses fetching from every assigned partition while in-flight work is at its bound."""
        if self._consumer is None:
            return
        if full:  # every time: a rebalance may have assigned partitions since
            self._consumer.pause(*self._consumer.assignment())
        elif self._paused:
            self._consumer.resume(*self._consumer.paused())
        self._paused = full

    def _spawn(
        self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes] | Unreadable, fetched: int
    ) -> None:
        if not self.tracker.register(tp, record.offset):
            return  # fetched again while its first fetch is still in flight: that one answers
        self.counters.consumed += 1
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
        if self.outbox is not None:  # the answers and the offsets, one transaction per partition
            try:
                self.tracker.committed(await self.outbox.commit(offsets))
            except PublishError as exc:
                self._fatal = exc
            return
        try:
            await self._consumer.commit(offsets)
        except (CommitFailedError, KafkaError, ValueError) as exc:
            # A rebalance took the partition away; the new owner re-delivers what we did not commit.
            log.warning("commit of %d partitions failed: %s", len(offsets), exc)
            return
        self.tracker.committed(offsets)

    # -- one record ---------------------------------------------------------------------------

    async def _handle(
        self,
        tp: TopicPartition,
        record: ConsumerRecord[bytes, bytes] | Unreadable,
        consumed_at: float,
        fetched: int,
    ) -> None:
        raw, refusal = self.answerer.read(record)
        if self._delivery is None:
            raise RuntimeError("a record handled before start")
        with process_span(self.tracer, raw, self.settings.consumer_group, fetched) as span:
            answer = await self.answerer.answer(raw, consumed_at, refusal)
            try:
                answer = await self._delivery.deliver(raw, answer)
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
        self.tracker.mark_done(tp, raw.offset)


async def unless_stopped(stop: asyncio.Event, step: Any) -> bool:
    """Runs `step` unless `stop` is set first (then cancels it): whether it completed."""
    work = asyncio.ensure_future(step)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if work.done():
        work.result()  # its exception, if any
        return True
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    return False


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
