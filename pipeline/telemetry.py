"""OpenTelemetry wiring: the tracer provider and its exporter, and the spans of the data path by
the semantic conventions (messaging, gen AI).

Per record one CONSUMER span (`process <topic>`, continuing the producer's `traceparent`, read
tolerantly: a header that is not UTF-8 must not freeze a partition) and per answer one PRODUCER
span (`send <topic>`, whose context goes into the record's own `traceparent`). Both are ours: the
aiokafka instrumentation added a root trace per poll, a second CONSUMER and a second PRODUCER span
off the conventions, and decoded headers strictly inside `getmany`; it is not used.
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
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from engine import GenerationResult
from pipeline.codec import RawRecord
from pipeline.settings import Settings

log = logging.getLogger(__name__)

TRACER_NAME = "deepanalyze"
PROVIDER = "deepanalyze"  # gen_ai.provider.name when the in-process engine serves the model

KafkaHeaders = Iterable[tuple[str, bytes | None]]


@dataclass(frozen=True)
class Telemetry:
    provider: TracerProvider
    tracer: trace.Tracer

    def shutdown(self) -> None:
        """Exports what is buffered (waiting at most 5 s for an unreachable collector), then stops."""
        self.provider.force_flush(timeout_millis=5_000)
        self.provider.shutdown()


def traces_endpoint(settings: Settings) -> str | None:
    """Where traces go: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT."""
    return settings.otel_exporter_otlp_traces_endpoint or settings.otel_exporter_otlp_endpoint


def span_exporter(settings: Settings) -> SpanExporter | None:
    """The OTLP exporter the OpenTelemetry variables ask for: none without an endpoint; gRPC or
    HTTP/protobuf by OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL. The
    exporter reads the endpoint (the traces' own first), headers and timeout from the environment."""
    if traces_endpoint(settings) is None:
        return None
    protocol = settings.otel_exporter_otlp_traces_protocol or settings.otel_exporter_otlp_protocol
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return Http()


def build_provider(settings: Settings) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": settings.otel_service_name}))
    if (exporter := span_exporter(settings)) is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
        protocol = type(exporter).__module__.split(".")[-2]
        log.info("exporting traces over OTLP (%s) to %s", protocol, traces_endpoint(settings))
    return provider


def setup_telemetry(settings: Settings, provider: TracerProvider | None = None) -> Telemetry:
    provider = provider or build_provider(settings)
    return Telemetry(provider, provider.get_tracer(TRACER_NAME))


def server_of(bootstrap_servers: str) -> tuple[str, int]:
    """`server.address` and `server.port` of the first bootstrap server ("[::1]:9092" -> ::1, 9092)."""
    host, _, port = bootstrap_servers.split(",")[0].strip().rpartition(":")
    return host.strip("[]"), int(port)


def start_send(
    tracer: trace.Tracer,
    topic: str,
    key: bytes | None,
    value: bytes | None,
    bootstrap_servers: str,
    context: Context | None = None,
) -> tuple[trace.Span, list[tuple[str, bytes]]]:
    """The PRODUCER span of one record sent to `topic` (a child of `context`, by default the
    current one), started, and the trace-context headers to put on the record so that its
    consumers continue the trace from this span. The caller ends it (`sent` first, on success)."""
    address, port = server_of(bootstrap_servers)
    attributes: dict[str, str | int] = {
        "messaging.system": "kafka",
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": topic,
        "messaging.message.body.size": len(value or b""),
        "server.address": address,
        "server.port": port,
    }
    if key is not None:
        attributes["messaging.kafka.message.key"] = key.decode("utf-8", errors="replace")
    span = tracer.start_span(
        f"send {topic}", context=context, kind=trace.SpanKind.PRODUCER, attributes=attributes
    )
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span, context))
    return span, [(name, text.encode("ascii")) for name, text in carrier.items()]


def sent(span: trace.Span, partition: int, offset: int) -> None:
    """Where the broker put the record of a `start_send` span."""
    span.set_attribute("messaging.destination.partition.id", str(partition))
    span.set_attribute("messaging.kafka.offset", offset)


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
    tracer: trace.Tracer,
    provider: str,
    model_id: str,
    submitted_ns: int,
    result: GenerationResult,
    attempt: int,
    max_tokens: int,
) -> None:
    """One generation's spans, laid out after the fact from the engine's own clock: `queue_wait`,
    then `chat <model>` (a client span with the `gen_ai.*` attributes, token usage on it alone)
    split into `prefill` (to the first token) and `decode`. The current span is their parent.
    Time to first token is a metric (`deepanalyze_time_to_first_token_seconds`), not an attribute."""
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
            "gen_ai.provider.name": provider,
            "gen_ai.request.model": model_id,
            "gen_ai.response.model": model_id,
            "gen_ai.request.max_tokens": max_tokens,
            "gen_ai.usage.input_tokens": result.prompt_tokens,
            "gen_ai.usage.output_tokens": result.output_tokens,
            "gen_ai.response.finish_reasons": [result.finish_reason],
            "deepanalyze.engine.batch_size": result.batch_size,
            "deepanalyze.attempt": attempt,
        },
    )
    inside = trace.set_span_in_context(generate)
    for name, start, end in (("prefill", scheduled_ns, first_ns), ("decode", first_ns, finished_ns)):
        tracer.start_span(name, context=inside, start_time=start).end(end_time=end)
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
