"""Publishing answers: an analysis event or a dead letter, acks=all, bounded retries, a span each.

The `publish <topic>` PRODUCER span follows the OpenTelemetry messaging conventions; the
aiokafka instrumentation's own send span (which carries the trace context in the record's
headers) hangs under it.
"""

from __future__ import annotations

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from opentelemetry import trace
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from pipeline.settings import Settings
from schemas import AnalysisEvent, DeadLetter

JSON_HEADERS = [("content-type", b"application/json")]


class PublishError(RuntimeError):
    """An answer could not be delivered after retries; the service stops without committing it."""


class Publisher:
    def __init__(self, producer: AIOKafkaProducer, settings: Settings, tracer: trace.Tracer) -> None:
        self.producer = producer
        self.settings = settings
        self.tracer = tracer

    async def publish(self, answer: AnalysisEvent | DeadLetter) -> None:
        if isinstance(answer, AnalysisEvent):
            topic, key = self.settings.topic_analysis, answer.document_id
        else:
            topic, key = self.settings.topic_dead_letters, answer.document_id or answer.event_id
        value = answer.model_dump_json().encode("utf-8")
        attributes: dict[str, str | int] = {
            "messaging.system": "kafka",
            "messaging.operation.type": "send",
            "messaging.operation.name": "publish",
            "messaging.destination.name": topic,
            "messaging.kafka.message.key": key,
            "messaging.message.body.size": len(value),
        }
        with self.tracer.start_as_current_span(
            f"publish {topic}", kind=trace.SpanKind.PRODUCER, attributes=attributes
        ) as span:
            try:
                async for attempt in AsyncRetrying(
                    retry=retry_if_exception_type(KafkaError),
                    wait=wait_exponential(multiplier=0.2, max=5),
                    stop=stop_after_attempt(5),
                    reraise=True,
                ):
                    with attempt:
                        sent = await self.producer.send_and_wait(
                            topic, value, key=key.encode("utf-8"), headers=list(JSON_HEADERS)
                        )
            except KafkaError as exc:
                raise PublishError(f"could not publish {answer.event_id} to {topic}: {exc}") from exc
            span.set_attribute("messaging.destination.partition.id", str(sent.partition))
            span.set_attribute("messaging.kafka.offset", sent.offset)
