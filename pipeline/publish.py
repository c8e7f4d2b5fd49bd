"""Publishing answers: an analysis event or a dead letter, acks=all, bounded retries, a span each.

The `send <topic>` PRODUCER span follows the OpenTelemetry messaging conventions, and its context
goes into the record's `traceparent` header, so a consumer downstream continues the trace.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    CorruptRecordException,
    InvalidTimestampError,
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
)
from opentelemetry import trace
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    retry_if_not_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from pipeline.codec import Document
from pipeline.settings import Settings
from pipeline.telemetry import sent, start_send
from schemas import AnalysisEvent, AnalysisProgress, DeadLetter

log = logging.getLogger(__name__)

JSON_HEADERS = [("content-type", b"application/json")]
# Errors about the record itself: sending it again cannot help, and they say nothing of the broker.
RECORD_ERRORS = (
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    CorruptRecordException,
    InvalidTimestampError,
)


class PublishError(RuntimeError):
    """An answer could not be delivered after retries; the service stops without committing it."""


class AnswerRejected(ValueError):
    """The broker (or the client, before sending) refused this answer record for what it is, e.g.
    its size: the record it answers gets a small dead letter instead, and the loop goes on."""


def answer_record(answer: AnalysisEvent | DeadLetter, settings: Settings) -> tuple[str, bytes, bytes]:
    """The answer's topic, key and value; AnswerRejected when larger than MAX_MESSAGE_BYTES.

    Keyed by the document's id; a dead letter of a record that could not be read keeps the record's
    own key (whole, in any bytes), so it lands beside its source's other records; without either,
    its event id."""
    if isinstance(answer, AnalysisEvent):
        topic, key_bytes = settings.topic_analysis, answer.document_id.encode("utf-8")
    else:
        topic, key_bytes = settings.topic_dead_letters, dead_letter_key(answer)
    value = answer.model_dump_json().encode("utf-8")
    if len(value) + len(key_bytes) > settings.max_message_bytes:
        raise AnswerRejected(
            f"the answer to {answer.event_id} has {len(value)} bytes; "
            f"MAX_MESSAGE_BYTES is {settings.max_message_bytes}"
        )
    return topic, key_bytes, value


def dead_letter_key(answer: DeadLetter) -> bytes:
    if answer.document_id:
        return answer.document_id.encode("utf-8")
    if answer.key_b64 and not answer.key_truncated:
        return base64.b64decode(answer.key_b64)
    return answer.event_id.encode("utf-8")


class Publisher:
    def __init__(self, producer: AIOKafkaProducer, settings: Settings, tracer: trace.Tracer) -> None:
        self.producer = producer
        self.settings = settings
        self.tracer = tracer

    async def publish(self, answer: AnalysisEvent | DeadLetter) -> None:
        topic, key, value = answer_record(answer, self.settings)
        span, context_headers = start_send(
            self.tracer, topic, key, value, self.settings.kafka_bootstrap_servers
        )
        with trace.use_span(span, end_on_exit=True):
            try:
                async for attempt in AsyncRetrying(
                    retry=retry_if_exception_type(KafkaError) & retry_if_not_exception_type(RECORD_ERRORS),
                    wait=wait_exponential(multiplier=0.2, max=5),
                    stop=stop_after_attempt(5),
                    reraise=True,
                ):
                    with attempt:
                        meta = await self.producer.send_and_wait(
                            topic, value, key=key, headers=[*JSON_HEADERS, *context_headers]
                        )
            except RECORD_ERRORS as exc:
                span.set_status(trace.StatusCode.ERROR, type(exc).__name__)
                raise AnswerRejected(
                    f"{topic} refused the answer to {answer.event_id}: {type(exc).__name__}"
                ) from exc
            except KafkaError as exc:
                raise PublishError(f"could not publish {answer.event_id} to {topic}: {exc}") from exc
            sent(span, meta.partition, meta.offset)


class ProgressSender:
    """Sends analyses as they are written (`answering.ProgressSink`) to TOPIC_PROGRESS, keyed by
    event id: fire and forget, outside any transaction (a lost record costs a page a preview,
    never an answer); at most `limit` sends outstanding, beyond that records are dropped."""

    def __init__(self, producer: AIOKafkaProducer, settings: Settings, limit: int = 1_000) -> None:
        self.producer = producer
        self.topic = settings.topic_progress
        self.limit = limit
        self._pending: set[asyncio.Task[None]] = set()

    def __call__(self, document: Document, written: dict[str, Any], count: int) -> None:
        if len(self._pending) >= self.limit:
            return
        record = AnalysisProgress(
            event_id=document.event_id, document_id=document.document_id, seq=count, analysis=written
        )
        task = asyncio.create_task(self._send(record), name=f"progress-{document.event_id}")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _send(self, record: AnalysisProgress) -> None:
        try:
            delivered = await self.producer.send(
                self.topic, record.model_dump_json().encode("utf-8"), key=record.event_id.encode(),
                headers=JSON_HEADERS,
            )  # fmt: skip
            await delivered
        except KafkaError as exc:
            log.debug("progress of %s not sent: %s", record.event_id, exc)
