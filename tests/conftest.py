"""Shared fixtures: one Kafka for the session, one tracer provider for the session.

Kafka: `KAFKA_BOOTSTRAP_SERVERS` when set; else a testcontainers Kafka when a Docker daemon
answers; else the embedded broker. Integration tests always talk to it over TCP.
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pipeline.broker import embedded_broker
from pipeline.settings import Settings, load_settings
from pipeline.telemetry import Telemetry, setup_telemetry


def _docker_answers() -> bool:
    """Whether a Docker daemon answers /_ping on its socket (the default one or DOCKER_HOST)."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if host.startswith("unix://"):
        family, address = socket.AF_UNIX, host.removeprefix("unix://")
    elif host.startswith("tcp://"):
        name, _, port = host.removeprefix("tcp://").rpartition(":")
        family, address = socket.AF_INET, (name, int(port))  # type: ignore[assignment]
    else:
        return False
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        try:
            sock.connect(address)
            sock.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
            return b"200 OK" in sock.recv(256)
        except OSError:
            return False


@contextlib.contextmanager
def _kafka() -> Iterator[str]:
    if servers := os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        yield servers
    elif _docker_answers():
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer().with_kraft() as kafka:
            yield kafka.get_bootstrap_server()
    else:
        with embedded_broker() as broker, pytest.MonkeyPatch.context() as env:
            if not broker.idempotent:  # the Tansu fallback: every settings of the session, workers too
                env.setenv("KAFKA_ENABLE_IDEMPOTENCE", "false")
            yield broker.bootstrap_servers


@pytest.fixture(scope="session")
def kafka_servers() -> Iterator[str]:
    with _kafka() as servers:
        yield servers


@pytest.fixture(scope="session")
def span_exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="session")
def telemetry(span_exporter: InMemorySpanExporter) -> Telemetry:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    return setup_telemetry(Settings(), provider)


@pytest.fixture
def settings(kafka_servers: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings on the session's Kafka with topics and a group of this test's own."""
    for name in list(os.environ):
        if name.startswith(("DYNAMIC_", "KV_", "MAX_", "TOPIC_", "MODEL_")):
            monkeypatch.delenv(name)
    run = uuid.uuid4().hex[:8]
    return load_settings(
        kafka_bootstrap_servers=kafka_servers,
        topic_complaints=f"t{run}.docs.complaints",
        topic_meeting_notes=f"t{run}.docs.meeting-notes",
        topic_filings=f"t{run}.docs.filings",
        topic_analysis=f"t{run}.analysis.events",
        topic_dead_letters=f"t{run}.analysis.dlq",
        topic_progress=f"t{run}.analysis.progress",
        topic_partitions=2,
        consumer_group=f"g{run}",
        session_timeout_ms=3_000,
        commit_interval_ms=200,
        status_port=0,
        # Services here mostly run on the scripted stand-in, a model without a polarity probe; the
        # real model's tests ask for POLARITY_FROM=probe (the default) themselves.
        polarity_from="question",
    )
