"""Exactly-once processing (`PROCESSING_GUARANTEE=exactly_once`): a record's answer and its
consumed offset are committed in one Kafka transaction, or neither is.

One transactional producer per assigned input partition, with a transactional id made of the
prefix and the partition (`<TRANSACTIONAL_ID_PREFIX>.<topic>.<partition>`). When the partition
moves to another worker (a rebalance, a restart, a worker presumed dead that is in fact alive),
the new owner's producer starts with the same id: that fences the old one, whose later commits
fail, and aborts whatever transaction it left open. aiokafka sends offsets to a transaction
without the group's generation (KIP-447), so the id per partition is what keeps a zombie out.

Answers wait in memory until every record before them in their partition is answered (batching
finishes documents out of order); at each commit a partition's answered prefix is published, its
offset sent to the same transaction, and the transaction committed. A consumer downstream that
reads with `isolation.level=read_committed` sees each answer once; one that reads uncommitted
may also see answers of aborted transactions (their records are re-delivered and answered again).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, ProducerFenced
from aiokafka.structs import TopicPartition
from opentelemetry import trace
from opentelemetry.context import Context, get_current

from pipeline.kafka import make_producer
from pipeline.publish import JSON_HEADERS, RECORD_ERRORS, PublishError, answer_record
from pipeline.settings import Settings
from pipeline.telemetry import sent, start_send
from schemas import AnalysisEvent, DeadLetter

log = logging.getLogger(__name__)

Answer = AnalysisEvent | DeadLetter
# What to publish instead of an answer the broker refused for what it is (its size): a small
# dead letter, made by the service. Called with the reason.
Replacement = Callable[[str], Answer]


class _Refused(Exception):
    """The broker refused answers in the transaction; it was aborted."""


@dataclass
class _Staged:
    offset: int
    answer: Answer
    replacement: Replacement
    context: Context  # the record's processing, which the answer's send span continues


def make_transactional_producer(settings: Settings, transactional_id: str) -> AIOKafkaProducer:
    return make_producer(
        settings,
        transactional_id=transactional_id,
        enable_idempotence=True,
        max_request_size=settings.max_message_bytes + 64 * 1024,
    )


class TransactionalOutbox:
    """Holds each assigned partition's answers until they can be committed with its offset."""

    def __init__(
        self,
        settings: Settings,
        tracer: trace.Tracer,
        make: Callable[[Settings, str], AIOKafkaProducer] = make_transactional_producer,
    ) -> None:
        self.settings = settings
        self.tracer = tracer
        self._make = make
        self._owned: set[TopicPartition] = set()  # assigned to this worker
        self._producers: dict[TopicPartition, AIOKafkaProducer] = {}
        self._starting: dict[TopicPartition, asyncio.Future[AIOKafkaProducer]] = {}
        self._staged: dict[TopicPartition, list[_Staged]] = {}
        self._lock = asyncio.Lock()  # one commit at a time: a transaction per producer at a time

    def transactional_id(self, tp: TopicPartition) -> str:
        prefix = self.settings.transactional_id_prefix or self.settings.consumer_group
        return f"{prefix}.{tp.topic}.{tp.partition}"

    def staged(self, tp: TopicPartition | None = None) -> int:
        if tp is not None:
            return len(self._staged.get(tp, ()))
        return sum(map(len, self._staged.values()))

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        """Starts a producer for each new partition; starting it fences the partition's previous
        owner and aborts the transaction it left open."""
        self._owned |= partitions
        await asyncio.gather(*(self._producer(tp) for tp in partitions))

    async def _producer(self, tp: TopicPartition) -> AIOKafkaProducer | None:
        """The partition's producer, started once however many ask for it at the same time (two
        with the same transactional id would fence each other); None when it cannot start now."""
        if (producer := self._producers.get(tp)) is not None:
            return producer
        starting = self._starting.get(tp)
        if starting is None:
            starting = self._starting[tp] = asyncio.ensure_future(self._start(tp))
            starting.add_done_callback(lambda _: self._starting.pop(tp, None))
        try:
            return await asyncio.shield(starting)
        except KafkaError as exc:
            log.warning("starting the transactional producer of %s[%d]: %s", tp.topic, tp.partition, exc)
            return None

    async def _start(self, tp: TopicPartition) -> AIOKafkaProducer:
        producer = self._make(self.settings, self.transactional_id(tp))
        try:
            await producer.start()
        except BaseException:
            await producer.stop()
            raise
        self._producers[tp] = producer
        return producer

    async def revoked(self, partitions: set[TopicPartition]) -> None:
        """Stops the partitions' producers and drops their uncommitted answers (the partitions'
        next owner is re-delivered their records)."""
        async with self._lock:  # not while one of their transactions is under way
            self._owned -= partitions
            for tp in partitions:
                self._staged.pop(tp, None)
            await asyncio.gather(*(self._stop(tp) for tp in partitions))

    async def _stop(self, tp: TopicPartition) -> None:
        producer = self._producers.pop(tp, None)
        if producer is not None:
            try:
                await producer.stop()
            except KafkaError as exc:
                log.warning("closing the transactional producer of %s[%d]: %s", tp.topic, tp.partition, exc)

    def stage(self, tp: TopicPartition, offset: int, answer: Answer, replacement: Replacement) -> None:
        """Keeps `answer` for the transaction that commits `offset`; `replacement` makes the small
        dead letter published instead if the broker refuses it. AnswerRejected when it is larger
        than MAX_MESSAGE_BYTES (the caller stages a small dead letter instead). The answer of a
        partition revoked meanwhile is dropped: its next owner answers the record again."""
        answer_record(answer, self.settings)  # the size check, before anything waits on it
        if tp in self._owned:
            self._staged.setdefault(tp, []).append(_Staged(offset, answer, replacement, get_current()))

    async def commit(self, offsets: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        """For each partition: its answers below the offset and the offset, in one transaction.
        Returns the offsets committed (a fenced or failed partition is left out)."""
        async with self._lock:
            done = await asyncio.gather(*(self._commit_one(tp, offset) for tp, offset in offsets.items()))
        return {tp: offset for (tp, offset), ok in zip(offsets.items(), done, strict=True) if ok}

    async def _commit_one(self, tp: TopicPartition, offset: int) -> bool:
        if tp not in self._owned:
            return False  # revoked meanwhile
        producer = await self._producer(tp)
        if producer is None:
            return False  # the broker is away; the next commit tries again
        ready = sorted((s for s in self._staged.get(tp, ()) if s.offset < offset), key=lambda s: s.offset)
        attributes: dict[str, str | int] = {
            "messaging.system": "kafka",
            "messaging.destination.name": tp.topic,
            "messaging.destination.partition.id": str(tp.partition),
            "messaging.batch.message_count": len(ready),
            "messaging.kafka.offset": offset,
        }
        with self.tracer.start_as_current_span("commit transaction", attributes=attributes) as span:
            for _ in range(2):  # a second try only after answers the broker refused were replaced
                refused: list[tuple[_Staged, str]] = []
                try:
                    await self._transaction(producer, tp, offset, ready, refused)
                except _Refused:
                    pass
                except ProducerFenced:
                    log.warning(
                        "%s[%d]: another worker took the partition over (fenced); its answers are theirs",
                        tp.topic,
                        tp.partition,
                    )
                    span.set_status(trace.StatusCode.ERROR, "fenced")
                    self._staged.pop(tp, None)
                    await self._stop(tp)
                    return False
                except KafkaError as exc:
                    log.warning("transaction for %s[%d] failed, retried at the next commit: %s",
                                tp.topic, tp.partition, exc)  # fmt: skip
                    span.set_status(trace.StatusCode.ERROR, type(exc).__name__)
                    await self._stop(tp)  # not reused: the next commit starts a new one, which fences it
                    return False
                if not refused:
                    left = [s for s in self._staged.get(tp, ()) if s.offset >= offset]
                    self._staged[tp] = left
                    return True
                for staged, reason in refused:
                    staged.answer = staged.replacement(reason)
            raise PublishError(f"{tp.topic}[{tp.partition}]: the broker refuses even the small dead letters")

    async def _transaction(
        self,
        producer: AIOKafkaProducer,
        tp: TopicPartition,
        offset: int,
        ready: list[_Staged],
        refused: list[tuple[_Staged, str]],
    ) -> None:
        """One transaction, committed; or aborted with `_Refused` after adding to `refused` the
        answers the broker refused for what they are."""
        spans: list[trace.Span] = []
        committed = False
        try:
            async with producer.transaction():  # aborted on any exception
                sends = []
                for staged in ready:
                    topic, key, value = answer_record(staged.answer, self.settings)
                    servers = self.settings.kafka_bootstrap_servers
                    span, context_headers = start_send(
                        self.tracer, topic, key, value, servers, staged.context
                    )
                    spans.append(span)
                    headers = [*JSON_HEADERS, *context_headers]
                    sends.append(await producer.send(topic, value, key=key, headers=headers))
                results = await asyncio.gather(*sends, return_exceptions=True)
                for span, result in zip(spans, results, strict=True):
                    if isinstance(result, BaseException):
                        span.set_status(trace.StatusCode.ERROR, type(result).__name__)
                    else:
                        sent(span, result.partition, result.offset)
                for staged, result in zip(ready, results, strict=True):
                    if isinstance(result, RECORD_ERRORS):
                        refused.append((staged, f"the broker refused the answer: {type(result).__name__}"))
                    elif isinstance(result, BaseException):
                        raise result
                if refused:
                    raise _Refused
                await producer.send_offsets_to_transaction({tp: offset}, self.settings.consumer_group)
            committed = True
        finally:
            for span in spans:
                if not committed:
                    span.set_status(trace.StatusCode.ERROR, "transaction aborted")
                span.end()

    async def close(self) -> None:
        self._owned.clear()
        self._staged.clear()
        for starting in list(self._starting.values()):
            starting.cancel()
        await asyncio.gather(*self._starting.values(), return_exceptions=True)
        await asyncio.gather(*(self._stop(tp) for tp in list(self._producers)))
