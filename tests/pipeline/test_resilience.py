"""The worker against its own embedded broker: a broker restart mid-run, and TLS end to end.

About delivery, not the model, so the analyser is the fast stand-in (`ScriptedEngine`). These
need a broker the test can stop and configure, so they always use the embedded one.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiokafka.errors import KafkaError

from pipeline.broker import embedded_broker, free_port
from pipeline.client import collect_answers, publish_documents
from pipeline.kafka import ensure_topics, wait_for_broker
from pipeline.service import Service, running
from pipeline.settings import Settings, load_settings
from pipeline.telemetry import Telemetry
from schemas import AnalysisEvent, DocumentEvent, DocumentKind
from tests.pipeline.fakes import ScriptedEngine

pytestmark = pytest.mark.integration
OPENSSL = shutil.which("openssl") or ""


def own_settings(servers: str, **extra: object) -> Settings:
    run = uuid.uuid4().hex[:8]
    return load_settings(
        kafka_bootstrap_servers=servers,
        consumer_group=f"g{run}",
        topic_partitions=2,
        session_timeout_ms=3_000,
        commit_interval_ms=200,
        **extra,
    )


def documents(prefix: str, n: int, kind: DocumentKind = DocumentKind.COMPLAINT) -> list[DocumentEvent]:
    return [
        DocumentEvent(document_id=f"{prefix}-{i}", kind=kind, text=f"第{i}号订单丢件了。") for i in range(n)
    ]


async def test_worker_reconnects_after_the_broker_restarts(telemetry: Telemetry) -> None:
    """Stopped and started mid-run, the embedded broker comes back empty (memory storage: topics,
    records, groups, committed offsets), which a real Kafka does not. A consumer keeps its fetch
    positions across a restart, so records re-published at offsets below them would be skipped:
    an artifact of the emptied log, not of the worker. So the documents before the restart go to
    one topic and those after to another, whose positions are still 0."""
    with embedded_broker() as broker:
        settings = own_settings(broker.bootstrap_servers)
        await ensure_topics(settings)
        before = await publish_documents(settings, documents("before", 5))
        service = Service(settings, ScriptedEngine(), telemetry)
        async with running(service, asyncio.Event()) as task:
            assert len(await collect_answers(settings, {s.event_id for s in before}, timeout_s=60)) == 5
            broker.stop()  # in-memory storage: topics, data and group state are gone
            await asyncio.sleep(3)
            broker.start()
            await ensure_topics(settings)  # an operator's (or Kafka's) topics would still exist
            after = await publish_documents(settings, documents("after", 5, DocumentKind.FILING))
            answers = await collect_answers(settings, {s.event_id for s in after}, timeout_s=120)
            assert not task.done(), "the worker gave up instead of reconnecting"
    assert {s.event_id for s in after} <= answers.keys()
    assert all(isinstance(found[0], AnalysisEvent) for found in answers.values())


def self_signed(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "broker.pem", folder / "broker.key"
    subprocess.run(
        [OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@contextlib.asynccontextmanager
async def tls_terminator(cert: Path, key: Path, port: int, upstream: int) -> AsyncIterator[list[int]]:
    """A TLS listener on `port` that forwards plaintext to the broker; yields a list that counts
    completed TLS handshakes. Tansu 0.6.0 cannot serve TLS itself (its `--cert` and `--key` are
    declared mutually exclusive, and either alone leaves the listener plaintext)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    handshakes: list[int] = []

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handshakes.append(1)
        broker_reader, broker_writer = await asyncio.open_connection("127.0.0.1", upstream)
        await asyncio.gather(pipe(reader, broker_writer), pipe(broker_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", port, ssl=context)
    try:
        yield handshakes
    finally:
        server.close()


@pytest.mark.skipif(not OPENSSL, reason="needs the openssl command to make a certificate")
async def test_tls_to_the_broker_end_to_end(telemetry: Telemetry, tmp_path: Path) -> None:
    """The worker, the publisher and the reader speak TLS only (KAFKA_SECURITY_PROTOCOL=SSL,
    server certificate checked against KAFKA_SSL_CAFILE, hostname included)."""
    cert, key = self_signed(tmp_path)
    tls_port = free_port()
    with embedded_broker(advertised_port=tls_port) as broker:  # clients are sent to the TLS port
        async with tls_terminator(cert, key, tls_port, broker.port) as handshakes:
            servers = f"127.0.0.1:{tls_port}"
            settings = own_settings(servers, kafka_security_protocol="SSL", kafka_ssl_cafile=cert)
            await ensure_topics(settings)
            sent = await publish_documents(settings, documents("tls", 3))
            service = Service(settings, ScriptedEngine(), telemetry)
            async with running(service, asyncio.Event()):
                answers = await collect_answers(settings, {s.event_id for s in sent}, timeout_s=60)
            assert len(answers) == 3 and handshakes
            # Plaintext to the TLS port fails, and so does TLS with a CA that did not sign the cert.
            (tmp_path / "other").mkdir()
            other, _ = self_signed(tmp_path / "other")
            for wrong in (
                own_settings(servers),
                own_settings(servers, kafka_security_protocol="SSL", kafka_ssl_cafile=other),
            ):
                with pytest.raises((KafkaError, OSError, asyncio.TimeoutError)):
                    await asyncio.wait_for(wait_for_broker(wrong, timeout_s=3), timeout=15)
