"""OpenTelemetry wiring: tracer provider, aiokafka instrumentation, trace-context helpers.

The aiokafka instrumentation patches the client classes process-wide, so it is applied once per
process with the first provider given; spans of ours come from the same provider. Only its
producer side is kept (the `send` span that puts the trace context into the record's headers):
its consumer side decodes those headers strictly inside `getmany`, so one record whose
`traceparent` is not UTF-8 made every fetch raise, froze the partition and dropped the records
fetched with it. The worker's own `process` span reads the context tolerantly instead.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from engine import GenerationResult
from pipeline.codec import RawRecord
from pipeline.settings import Settings

log = logging.getLogger(__name__)

TRACER_NAME = "deepanalyze"

KafkaHeaders = Iterable[tuple[str, bytes | None]]


@dataclass(frozen=True)
class Telemetry:
    provider: TracerProvider
    tracer: trace.Tracer

    def shutdown(self) -> None:
        """Exports what is buffered (waiting at most 5 s for an unreachable collector), then stops."""
        self.provider.force_flush(timeout_millis=5_000)
        self.provider.shutdown()


def build_provider(settings: Settings) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": settings.otel_service_name}))
    if settings.otel_exporter_otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        log.info("exporting traces over OTLP to %s", settings.otel_exporter_otlp_endpoint)
    return provider


def setup_telemetry(settings: Settings, provider: TracerProvider | None = None) -> Telemetry:
    from aiokafka import AIOKafkaConsumer
    from opentelemetry.instrumentation.aiokafka import AIOKafkaInstrumentor
    from opentelemetry.instrumentation.utils import unwrap

    provider = provider or build_provider(settings)
    instrumentor = AIOKafkaInstrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument(tracer_provider=provider)
        unwrap(AIOKafkaConsumer, "getone")
        unwrap(AIOKafkaConsumer, "getmany")
    return Telemetry(provider, provider.get_tracer(TRACER_NAME))


class _HeaderGetter(Getter[KafkaHeaders]):
    def get(self, carrier: KafkaHeaders, key: str) -> list[str] | None:
        values = [v.decode("utf-8", errors="replace") for k, v in carrier if k == key and v is not None]
        return values or None

    def keys(self, carrier: KafkaHeaders) -> list[str]:
        return [k for k, _ in carrier]


def extract_context(headers: Any) -> Context:
    """The producer's trace context from a record's headers (empty context when there is none)."""
    return propagate.extract(list(headers or ()), getter=_HeaderGetter())


def current_trace_id() -> str | None:
    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None


def record_generation(
    tracer: trace.Tracer, model_id: str, submitted_ns: int, result: GenerationResult, attempt: int
) -> None:
    """One generation's spans, laid out after the fact from the engine's own clock: `queue_wait`,
    then `chat <model>` (a client span with the `gen_ai.*` attributes) split into `prefill` (to
    the first token) and `decode`. The current span is their parent."""
    scheduled_ns = submitted_ns + int(result.queued_s * 1e9)
    first_ns = submitted_ns + int(result.ttft_s * 1e9)
    finished_ns = submitted_ns + int(result.total_s * 1e9)
    queue_wait = tracer.start_span(
        "queue_wait", start_time=submitted_ns, attributes={"deepanalyze.attempt": attempt}
    )
    queue_wait.end(end_time=scheduled_ns)
    generate = tracer.start_span(
        f"chat {model_id}",
        kind=trace.SpanKind.CLIENT,
        start_time=scheduled_ns,
        attributes={
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": model_id,
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
        attributes: dict[str, str | int] = {**usage, "gen_ai.request.model": model_id}
        tracer.start_span(name, context=inside, start_time=start, attributes=attributes).end(end_time=end)
    generate.end(end_time=finished_ns)


def process_span(
    tracer: trace.Tracer, raw: RawRecord, group: str, fetched: int
) -> AbstractContextManager[trace.Span]:
    """The consumer span of one record's processing, a child of the producer's trace (its
    `traceparent` header), with the messaging conventions' attributes."""
    attributes: dict[str, str | int] = {
        "messaging.system": "kafka",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": raw.topic,
        "messaging.destination.partition.id": str(raw.partition),
        "messaging.consumer.group.name": group,
        "messaging.kafka.offset": raw.offset,
        "messaging.batch.message_count": fetched,  # records in the poll that brought it
        "messaging.message.body.size": len(raw.value or b""),
    }
    return tracer.start_as_current_span(
        f"process {raw.topic}",
        context=extract_context(raw.headers),
        kind=trace.SpanKind.CONSUMER,
        attributes=attributes,
    )
