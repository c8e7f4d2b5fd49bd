"""The user's side of the bus: publish documents, collect their answers by event id.

Used by `deepanalyze publish` / `tail`, the demo and the tests. Answers are matched to what was
sent through the event id, derived from the coordinates and timestamp the broker acknowledged and
the bytes sent (`event_id_for`).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import RecordMetadata, TopicPartition
from opentelemetry import trace
from pydantic import ValidationError

from pipeline.codec import encode_document
from pipeline.kafka import make_consumer, make_producer, partitions_of
from pipeline.settings import Settings
from pipeline.telemetry import TRACER_NAME, sent, start_send
from schemas import AnalysisEvent, DeadLetter, DocumentEvent, DocumentKind, event_id_for

Answer = AnalysisEvent | DeadLetter
LOG_APPEND_TIME = 1  # a record's timestamp type: the broker's time, not the producer's


@dataclass(frozen=True)
class Sent:
    document_id: str
    topic: str
    partition: int
    offset: int
    event_id: str  # the id its answer will carry

    @classmethod
    def of(cls, document_id: str, meta: RecordMetadata, value: bytes | None, timestamp_ms: int) -> Sent:
        """From the broker's acknowledgement of `value`, sent with `timestamp_ms`."""
        return cls(document_id, meta.topic, meta.partition, meta.offset, answer_id(meta, value, timestamp_ms))


def answer_id(
    meta: RecordMetadata, value: bytes | None, timestamp_ms: int, append_time: bool | None = None
) -> str:
    """The event id of the answer to a record sent with `timestamp_ms` and acknowledged with `meta`.

    The record's timestamp is the one the producer set, unless the topic stamps records with the
    broker's time (LogAppendTime): `append_time` says whether it does; None trusts the
    acknowledgement's timestamp type, which is right for the service's own (non-idempotent)
    producers and wrong for an idempotent one: a batch it sends again after a leader change, which
    the broker finds already written, is acknowledged with the batch's largest CreateTime reported
    as a log-append time (Kafka's duplicate-batch reply), not the time of the batch's other records.
    The acknowledgement's timestamp is not used otherwise: for a batch of records aiokafka reports
    the first record's time for all of them on some brokers."""
    broker_time = meta.timestamp_type == LOG_APPEND_TIME if append_time is None else append_time
    timestamp = meta.timestamp if broker_time else timestamp_ms
    return event_id_for(meta.topic, meta.partition, meta.offset, timestamp, value)


def _json_document(data: str | bytes, kind: str | None) -> DocumentEvent:
    """A DocumentEvent in JSON, its kind replaced by `kind` when one is given."""
    event = DocumentEvent.model_validate_json(data)
    return event.model_copy(update={"kind": kind}) if kind else event


def documents_from_lines(text: str, source: str, kind: str | None = None) -> list[DocumentEvent]:
    """One document per non-blank line: a line that begins with "{" is a DocumentEvent in JSON,
    any other its text (id: `source` and the line's number)."""
    documents = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            if line.lstrip().startswith("{"):
                documents.append(_json_document(line, kind))
            else:
                documents.append(DocumentEvent(document_id=f"{source}-{number}", kind=kind, text=line))
        except ValidationError as exc:
            raise ValueError(f"{source} line {number} is not a publishable document: {exc}") from exc
    return documents


def load_documents(
    paths: Iterable[Path], kind: str | None = None, *, lines: bool = False
) -> list[DocumentEvent]:
    """`*.json` files as DocumentEvents, anything else as plain text (id = file name); folders expand.
    With `lines`, every file holds one document per line (`documents_from_lines`)."""
    documents = []
    for path in paths:
        if path.is_dir():
            documents += load_documents(sorted(p for p in path.iterdir() if p.is_file()), kind, lines=lines)
            continue
        try:
            if lines:
                documents += documents_from_lines(path.read_text(encoding="utf-8"), path.stem, kind)
            elif path.suffix == ".json":
                documents.append(_json_document(path.read_bytes(), kind))
            else:
                text = path.read_text(encoding="utf-8")
                documents.append(DocumentEvent(document_id=path.stem, kind=kind, text=text))
        except (UnicodeDecodeError, ValidationError) as exc:
            raise ValueError(f"{path} is not a publishable document: {exc}") from exc
    return documents


async def send_document(
    producer: AIOKafkaProducer,
    settings: Settings,
    document: DocumentEvent,
    *,
    topic: str | None = None,
    key: bytes | None = None,
    headers: Sequence[tuple[str, bytes]] = (),
    tracer: trace.Tracer | None = None,
) -> Sent:
    """Publishes one document to `topic`, by default its kind's input topic, keyed by `key`, by
    default its document id, with `headers` after the document's own and the trace context (a
    `send <topic>` PRODUCER span under the current one); returns where the broker put it."""
    topic = topic or settings.topic_for(document.kind or DocumentKind.COMPLAINT)
    value, own_headers = encode_document(document)
    key = key if key is not None else (document.document_id or "").encode("utf-8") or None
    now_ms = int(time.time() * 1000)
    tracer = tracer or trace.get_tracer(TRACER_NAME)  # by default the process's provider, if any
    span, context_headers = start_send(tracer, topic, key, value, settings.kafka_bootstrap_servers)
    with trace.use_span(span, end_on_exit=True):
        meta = await producer.send_and_wait(
            topic, value, key=key, headers=[*own_headers, *context_headers, *headers], timestamp_ms=now_ms
        )
        sent(span, meta.partition, meta.offset)
    return Sent.of(document.document_id or f"{topic}/{meta.partition}/{meta.offset}", meta, value, now_ms)


async def publish_documents(
    settings: Settings,
    documents: Iterable[DocumentEvent],
    *,
    topic: str | None = None,
    key: bytes | None = None,
    headers: Sequence[tuple[str, bytes]] = (),
    tracer: trace.Tracer | None = None,
) -> list[Sent]:
    """Publishes documents one after another (see `send_document` for the options)."""
    producer = make_producer(settings)
    try:
        await producer.start()  # inside: a start that fails still closes what it opened
        return [
            await send_document(
                producer, settings, document, topic=topic, key=key, headers=headers, tracer=tracer
            )
            for document in documents
        ]
    finally:
        await producer.stop()


async def publish_raw(
    settings: Settings,
    topic: str,
    value: bytes | None,
    key: bytes | None = None,
    headers: list[tuple[str, bytes]] | None = None,
) -> Sent:
    producer = make_producer(settings)
    try:
        await producer.start()
        now_ms = int(time.time() * 1000)
        meta = await producer.send_and_wait(topic, value, key=key, headers=headers or [], timestamp_ms=now_ms)
        return Sent.of(key.decode(errors="replace") if key else "", meta, value, now_ms)
    finally:
        await producer.stop()


def parse_answer(topic: str, value: bytes, settings: Settings) -> Answer | None:
    try:
        if topic == settings.topic_analysis:
            return AnalysisEvent.model_validate_json(value)
        return DeadLetter.model_validate_json(value)
    except ValidationError:
        return None


async def collect_answers(
    settings: Settings, expected: set[str] | None, timeout_s: float, *, count: int | None = None
) -> dict[str, list[Answer]]:
    """Reads both answer topics from the beginning until every expected event id has an answer
    (or `count` answers arrived), or the timeout passes. Keeps duplicates, keyed by event id."""
    answers: dict[str, list[Answer]] = {}
    found = follow_answers(settings, from_beginning=True, count=count, timeout_s=timeout_s)
    async with contextlib.aclosing(found):
        async for answer in found:
            answers.setdefault(answer.event_id, []).append(answer)
            if expected is not None and expected <= answers.keys():
                break
    return answers


async def follow_answers(
    settings: Settings,
    *,
    from_beginning: bool = False,
    count: int | None = None,
    timeout_s: float | None = None,
    on_ready: Callable[[], None] | None = None,
) -> AsyncGenerator[Answer, None]:
    """Answers as they arrive on both answer topics, from their end (or beginning), one at a time:
    exactly `count` of them at most, for `timeout_s` at most (None: until the caller stops).
    `on_ready` is called once the consumer holds its positions: anything answered later is seen."""
    consumer = make_consumer(settings, grouped=False)
    try:
        await consumer.start()
        await assign_answer_topics(consumer, settings, from_beginning=from_beginning)
        if on_ready is not None:
            on_ready()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        seen = 0
        while count is None or seen < count:
            wait_s = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if wait_s <= 0:
                return
            batch = await consumer.getmany(timeout_ms=int(wait_s * 1000))
            for tp, records in batch.items():
                for record in records:
                    answer = parse_answer(tp.topic, record.value, settings)
                    if answer is None:
                        continue
                    yield answer
                    seen += 1
                    if count is not None and seen >= count:
                        return
    finally:
        await consumer.stop()


async def assign_answer_topics(
    consumer: AIOKafkaConsumer, settings: Settings, *, from_beginning: bool = True, progress: bool = False
) -> list[TopicPartition]:
    """Assigns every partition of the analysis and dead-letter topics (and, with `progress`, the
    progress topic) to a group-less consumer, positioned at their beginning (or their end)."""
    topics = [settings.topic_analysis, settings.topic_dead_letters]
    found = await partitions_of(settings, [*topics, settings.topic_progress] if progress else topics)
    partitions = [TopicPartition(topic, p) for topic, numbers in found.items() for p in numbers]
    consumer.assign(partitions)
    if from_beginning:
        await consumer.seek_to_beginning(*partitions)
    else:
        await consumer.seek_to_end(*partitions)
        for tp in partitions:  # resolve the end now: what arrives from here on is printed
            await consumer.position(tp)
    return partitions


def dump_answer(answer: Answer) -> str:
    """One answer as one line of JSON (JSON Lines, as `jq -c` and kcat print)."""
    return json.dumps(answer.model_dump(mode="json"), ensure_ascii=False, separators=(",", ":"))
