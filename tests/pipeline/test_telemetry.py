"""Traces as a collector receives them: the standard OTLP variables choose where and how (HTTP or
gRPC), and the exported protobuf holds one tree per document by the semantic conventions."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from pipeline.client import collect_answers, publish_documents
from pipeline.kafka import ensure_topics
from pipeline.service import Service, running
from pipeline.settings import Settings
from pipeline.telemetry import server_of, setup_telemetry, span_exporter
from schemas import AnalysisEvent
from tests.pipeline.fakes import ScriptedEngine
from tests.pipeline.test_service import good_documents

Received = list[trace_service_pb2.ExportTraceServiceRequest]


@contextmanager
def http_receiver() -> Iterator[tuple[str, Received]]:
    """An OTLP/HTTP receiver on a free port: the traces URL, and every request it decoded."""
    received: Received = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            assert self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf"
            received.append(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()
            self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1/traces", received
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def grpc_receiver() -> Iterator[tuple[str, Received]]:
    """An OTLP/gRPC receiver on a free port: its endpoint, and every request it got."""
    received: Received = []

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", received
    finally:
        server.stop(None)


def spans_of(received: Received) -> list[Span]:
    return [s for r in received for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]


def attributes(span: Span) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        found[kv.key] = getattr(kv.value, kind) if kind != "array_value" else kv.value.array_value
    return found


def test_no_endpoint_no_exporter_and_the_traces_endpoint_alone_is_enough(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert span_exporter(Settings()) is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1/traces")
    exporter = span_exporter(Settings())
    assert exporter is not None and type(exporter).__module__.endswith("http.trace_exporter")


@pytest.mark.parametrize(
    ("general", "traces", "expected"),
    [("grpc", None, "grpc"), ("http/protobuf", "grpc", "grpc"), ("grpc", "http/protobuf", "http")],
)
def test_the_traces_protocol_wins_over_the_general_one(
    monkeypatch: pytest.MonkeyPatch, general: str, traces: str | None, expected: str
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", general)
    if traces is not None:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", traces)
    exporter = span_exporter(Settings())
    assert exporter is not None and type(exporter).__module__.split(".")[-2] == expected


def test_spans_reach_a_grpc_receiver_when_the_protocol_says_grpc(monkeypatch: pytest.MonkeyPatch) -> None:
    with grpc_receiver() as (endpoint, received):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        telemetry = setup_telemetry(Settings())
        with telemetry.tracer.start_as_current_span("hello"):
            pass
        telemetry.shutdown()
    assert [s.name for s in spans_of(received)] == ["hello"]


def test_the_server_of_a_bootstrap_list_is_its_first_host_and_port() -> None:
    assert server_of("kafka-0.kafka:9093,kafka-1.kafka:9093") == ("kafka-0.kafka", 9093)
    assert server_of("[::1]:9092") == ("::1", 9092)


@pytest.mark.integration
async def test_the_exported_protobuf_holds_one_tree_per_document_by_the_conventions(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decoded as a collector decodes it: each document's trace is rooted at the publisher's
    `send` span, with one CONSUMER span continuing it, one PRODUCER span for the answer, the
    chat span's required gen_ai attributes, token usage once; no span outside those trees."""
    await ensure_topics(settings)
    with http_receiver() as (url, received):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", url)
        telemetry = setup_telemetry(
            Settings(**{**settings.model_dump(), "otel_exporter_otlp_traces_endpoint": url})
        )
        documents = good_documents(3)
        await publish_documents(settings, documents, tracer=telemetry.tracer)
        service = Service(settings, ScriptedEngine(), telemetry)
        async with running(service, asyncio.Event()):
            answers = await collect_answers(settings, None, timeout_s=60, count=len(documents))
        await asyncio.to_thread(telemetry.shutdown)
    spans = spans_of(received)
    by_trace: dict[bytes, list[Span]] = {}
    for span in spans:
        by_trace.setdefault(span.trace_id, []).append(span)
    assert len(by_trace) == len(documents)  # no stray trace (a poll, a commit) beside them
    events = [a[0] for a in answers.values()]
    assert {bytes.fromhex(e.trace_id or "") for e in events if isinstance(e, AnalysisEvent)} == set(by_trace)
    for tree in by_trace.values():
        ids = {s.span_id for s in tree}
        (root,) = [s for s in tree if not s.parent_span_id]
        assert all(s.parent_span_id in ids for s in tree if s is not root)  # one connected tree
        assert root.kind == Span.SPAN_KIND_PRODUCER and root.name.startswith("send ")
        (consumer,) = [s for s in tree if s.kind == Span.SPAN_KIND_CONSUMER]
        assert consumer.parent_span_id == root.span_id and consumer.name == "process " + root.name[5:]
        producers = [s for s in tree if s.kind == Span.SPAN_KIND_PRODUCER]
        assert len(producers) == 2
        (answer,) = [s for s in producers if s is not root]
        assert answer.name == f"send {settings.topic_analysis}" and answer.parent_span_id == consumer.span_id
        for span in (root, answer):
            attrs = attributes(span)
            assert attrs["messaging.system"] == "kafka" and attrs["messaging.operation.type"] == "send"
            assert attrs["server.address"] == settings.kafka_bootstrap_servers.split(":")[0]
            assert isinstance(attrs["server.port"], int) and "messaging.destination.partition.id" in attrs
        (chat,) = [s for s in tree if s.kind == Span.SPAN_KIND_CLIENT]
        attrs = attributes(chat)
        assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.provider.name"] == "deepanalyze"
        assert attrs["gen_ai.request.model"] == "scripted" and attrs["gen_ai.usage.input_tokens"] > 0
        with_usage = [s.name for s in tree if any(k.startswith("gen_ai.usage") for k in attributes(s))]
        assert with_usage == [chat.name]
