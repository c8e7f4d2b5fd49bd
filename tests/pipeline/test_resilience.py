"""The worker against a broker of its own: a broker restart mid-run, TLS end to end, and a
worker process told to stop (SIGTERM) while the broker is missing, and what it logs meanwhile.

About delivery, not the model, so the analyser is the fast stand-in (`ScriptedEngine`). These
need a broker the test can stop and configure, so they always use the embedded one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiokafka.errors import KafkaError

from pipeline.broker import Broker, embedded_broker, free_port
from pipeline.client import collect_answers, publish_documents
from pipeline.kafka import ensure_topics, wait_for_broker
from pipeline.service import Service, running
from pipeline.settings import Settings, child_env, load_settings
from pipeline.telemetry import Telemetry
from schemas import AnalysisEvent, DocumentEvent, DocumentKind
from tests.pipeline.fakes import ScriptedEngine
from tests.pipeline.test_service import ROOT

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
        polarity_from="question",  # the scripted stand-in has no polarity probe
        **extra,
    )


def documents(prefix: str, n: int, kind: DocumentKind = DocumentKind.COMPLAINT) -> list[DocumentEvent]:
    return [
        DocumentEvent(document_id=f"{prefix}-{i}", kind=kind, text=f"第{i}号订单丢件了。") for i in range(n)
    ]


async def test_worker_reconnects_after_the_broker_restarts(telemetry: Telemetry) -> None:
    """The broker stopped and started mid-run: the worker reconnects and answers what comes
    after. Apache Kafka comes back with its topics, records and offsets; the Tansu fallback comes
    back empty, where a consumer's kept fetch positions would skip records re-published below
    them (an artifact of the emptied log, not of the worker). So the documents before the restart
    go to one topic and those after to another, whose positions are still 0, on either broker."""
    with embedded_broker() as broker:
        settings = own_settings(broker.bootstrap_servers)
        await ensure_topics(settings)
        before = await publish_documents(settings, documents("before", 5))
        service = Service(settings, ScriptedEngine(), telemetry)
        async with running(service, asyncio.Event()) as task:
            assert len(await collect_answers(settings, {s.event_id for s in before}, timeout_s=60)) == 5
            broker.stop()
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


# -- a worker process told to stop while the broker is missing --------------------------------


@dataclass
class WorkerProcess:
    """`python -m tests.pipeline.worker`, with what it logs (its stderr) collected line by line."""

    process: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)

    async def read(self) -> None:
        assert self.process.stderr is not None
        async for line in self.process.stderr:
            self.lines.append(line.decode(errors="replace"))

    def count(self, pattern: str) -> int:
        return sum(bool(re.search(pattern, line)) for line in self.lines)

    def tail(self, n: int = 40) -> str:
        return "".join(self.lines[-n:])

    async def wait_for(self, pattern: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.count(pattern):
            code = self.process.returncode
            assert code is None, f"the worker exited ({code}):\n{self.tail()}"
            assert time.monotonic() < deadline, f"no {pattern!r} logged within {timeout_s} s:\n{self.tail()}"
            await asyncio.sleep(0.1)

    async def terminate(self, timeout_s: float) -> tuple[int | None, float]:
        """SIGTERM: its exit status (None: it was still running after `timeout_s` and was
        SIGKILLed) and the seconds it took to exit."""
        sent = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(self.process.wait(), timeout_s)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()
            return None, time.monotonic() - sent
        return code, time.monotonic() - sent


@contextlib.asynccontextmanager
async def worker_process(settings: Settings, **env: str) -> AsyncIterator[WorkerProcess]:
    """A worker process on `settings`, with extra environment (SCRIPTED_DELAY_S is required)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.pipeline.worker",
        cwd=ROOT,
        env=child_env(settings, os.environ) | {"PYTHONPATH": str(ROOT)} | env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    worker = WorkerProcess(process)
    reading = asyncio.create_task(worker.read())
    try:
        yield worker
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await reading


def kill(broker: Broker) -> None:
    """Takes the broker away at once (kill -9)."""
    broker.kill()


async def test_sigterm_while_waiting_for_the_broker_exits_at_once() -> None:
    """Start-up waits up to BROKER_WAIT_S for Kafka; a SIGTERM then (a rollout, a scale-down, a
    mistyped address being fixed) must end it at once, not after the wait: the issue saw 20 s+.
    Nothing listens on the port, so the worker is in that wait for as long as it lasts."""
    settings = own_settings(f"127.0.0.1:{free_port()}")
    async with worker_process(settings, SCRIPTED_DELAY_S="0", BROKER_WAIT_S="60") as worker:
        await worker.wait_for(r"ERROR aiokafka", timeout_s=60)  # a failed attempt: it is waiting
        code, took_s = await worker.terminate(timeout_s=20)
    assert code == 0, f"exit status {code} after {took_s:.1f} s:\n{worker.tail()}"
    assert took_s < 5, f"took {took_s:.1f} s to stop:\n{worker.tail()}"


async def test_sigterm_with_the_broker_gone_exits_within_grace_and_close() -> None:
    """The issue: broker stopped mid-run, then SIGTERM; the worker gave up its in-flight documents
    after the grace, then hung committing and closing against the missing broker until SIGKILL.
    Here two documents are answered just before the broker dies and two are mid-analysis; the
    SIGTERM comes once the periodic commit of the first two has started against the dead broker,
    so every closing step meets it: that commit, the final one, leaving the group, closing the
    producer. The worker must abandon the two after SHUTDOWN_GRACE_S, give up committing and
    closing after SHUTDOWN_CLOSE_S (all steps together: one bound each would add up past a pod's
    termination grace) and exit 0 by itself. What it did not commit is not lost: Kafka re-delivers
    it to the partitions' next owner. That part cannot be checked here (the memory-only broker
    loses everything when it stops), so this checks the exit, and that the two were abandoned."""
    grace_s, close_s, commit_interval_s = 2.0, 3.0, 3.0
    with embedded_broker() as broker:
        settings = own_settings(broker.bootstrap_servers)
        await ensure_topics(settings)
        await publish_documents(settings, documents("gone", 4))
        async with worker_process(
            settings,
            SCRIPTED_DELAY_S="10",  # the two fetched after the first two outlive the grace
            MAX_INFLIGHT="2",
            COMMIT_INTERVAL_MS=str(int(commit_interval_s * 1000)),
            SHUTDOWN_GRACE_S=str(grace_s),
            SHUTDOWN_CLOSE_S=str(close_s),
        ) as worker:
            answered = await collect_answers(settings, None, timeout_s=60, count=2)
            assert sum(map(len, answered.values())) == 2, "the other two should be mid-analysis"
            kill(broker)
            await asyncio.sleep(commit_interval_s + 0.5)  # their commit is under way, and stuck
            code, took_s = await worker.terminate(timeout_s=30)
    assert code == 0, f"exit status {code} after {took_s:.1f} s:\n{worker.tail()}"
    assert took_s < grace_s + close_s + 2, f"took {took_s:.1f} s to stop:\n{worker.tail()}"
    assert worker.count(r"abandoning 2 unfinished documents \(not committed"), worker.tail()


async def test_a_broker_outage_is_logged_per_state_change_not_per_retry() -> None:
    """The issue: ~7,900 `ERROR aiokafka` lines in 80 s with the broker down (unfiltered, each
    client retries several times a second per node), burying everything else. Over a 20 s
    outage and the recovery the worker may write only a few dozen of them (repeats held back
    with doubling pauses, `RepeatFilter`), and says itself, once each, that the cluster became
    unreachable and that it is reachable again."""
    with embedded_broker() as broker:
        settings = own_settings(broker.bootstrap_servers)
        await ensure_topics(settings)
        sent = await publish_documents(settings, documents("outage", 3))
        async with worker_process(settings, SCRIPTED_DELAY_S="0.05", CLUSTER_CHECK_INTERVAL_S="1") as worker:
            assert len(await collect_answers(settings, {s.event_id for s in sent}, timeout_s=60)) == 3
            kill(broker)
            await asyncio.sleep(20)
            broker.start()
            await worker.wait_for(r"Kafka cluster reachable again", timeout_s=30)
            code, _ = await worker.terminate(timeout_s=30)
    complaints = worker.count(r" (WARNING|ERROR|CRITICAL) aiokafka")
    assert complaints < 100, f"{complaints} lines from the Kafka client:\n{worker.tail()}"
    assert worker.count(r"Kafka cluster unreachable") == 1, worker.tail()
    assert worker.count(r"Kafka cluster reachable again") == 1, worker.tail()
    assert code == 0, worker.tail()
