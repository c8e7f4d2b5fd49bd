"""Exactly-once processing (`PROCESSING_GUARANTEE=exactly_once`) on Apache Kafka: a reader with
`read_committed` sees each record's answer once, through worker crashes; a worker whose
partition was taken over (a zombie) cannot commit; answers and offsets move together."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition
from opentelemetry import trace

from pipeline.client import collect_answers, publish_documents
from pipeline.codec import RawRecord, dead_letter
from pipeline.kafka import client_options, ensure_topics
from pipeline.kafka_broker import run_tool, unavailable_reason
from pipeline.service import Service, running
from pipeline.settings import Settings, child_env
from pipeline.telemetry import Telemetry
from pipeline.transactions import TransactionalOutbox
from schemas import AnalysisEvent, DeadLetter, DeadLetterReason
from tests.pipeline.fakes import ScriptedEngine
from tests.pipeline.test_service import (
    ROOT,
    committed_offsets,
    good_documents,
    partition_ends,
    publish_bad,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(unavailable_reason() is not None, reason="needs Apache Kafka (transactions)"),
]


def exactly_once(settings: Settings, **extra: object) -> Settings:
    return Settings(**{**settings.model_dump(), "processing_guarantee": "exactly_once", **extra})


async def test_every_record_answered_once_and_committed_in_transactions(
    settings: Settings, telemetry: Telemetry
) -> None:
    settings = exactly_once(settings, max_document_chars=4000)
    await ensure_topics(settings)
    sent = await publish_documents(settings, good_documents(30))
    bad = await publish_bad(settings)
    service = Service(settings, ScriptedEngine(), telemetry)
    async with running(service, asyncio.Event()):
        answers = await collect_answers(settings, {s.event_id for s in sent} | set(bad), timeout_s=60)
    assert set(answers) == {s.event_id for s in sent} | set(bad)
    assert all(len(found) == 1 for found in answers.values())
    assert all(isinstance(answers[s.event_id][0], AnalysisEvent) for s in sent)
    assert {e: a[0].error_type for e, a in answers.items() if isinstance(a[0], DeadLetter)} == bad
    ends = partition_ends(sent)
    committed = await committed_offsets(settings, set(ends))
    assert all((committed[tp] or 0) >= end for tp, end in ends.items()), (committed, ends)


def _letter(tp: TopicPartition, offset: int, note: str) -> DeadLetter:
    raw = RawRecord(tp.topic, tp.partition, offset, 0, None, note.encode())
    return dead_letter(raw, reason=DeadLetterReason.EMPTY_TEXT, message=note)


async def test_a_zombie_is_fenced_and_its_answers_never_become_visible(settings: Settings) -> None:
    """Worker A holds an answer for offset 0 when the partition moves to worker B (A is presumed
    dead, but is not). B's producer starts with the partition's transactional id, which fences
    A: A's commit fails and its answer never reaches a read_committed reader; B's does, once."""
    settings = exactly_once(settings, topic_partitions=1)
    await ensure_topics(settings)
    tracer = trace.get_tracer(__name__)
    tp = TopicPartition(settings.topic_complaints, 0)
    zombie, owner = TransactionalOutbox(settings, tracer), TransactionalOutbox(settings, tracer)
    try:
        await zombie.assigned({tp})
        zombie.stage(tp, 0, _letter(tp, 0, "zombie"), lambda reason: _letter(tp, 0, reason))
        await owner.assigned({tp})  # the rebalance gives the partition to B
        owner.stage(tp, 0, _letter(tp, 0, "owner"), lambda reason: _letter(tp, 0, reason))
        assert await zombie.commit({tp: 1}) == {}
        assert await owner.commit({tp: 1}) == {tp: 1}
    finally:
        await zombie.close()
        await owner.close()
    letters = await collect_answers(settings, None, timeout_s=5)
    messages = [a.error_message for found in letters.values() for a in found if isinstance(a, DeadLetter)]
    assert messages == ["owner"]
    assert (await committed_offsets(settings, {tp}))[tp] == 1


async def test_an_aborted_transaction_is_invisible_to_read_committed_readers(settings: Settings) -> None:
    """What read_committed buys a downstream consumer: a transaction that never committed (its
    worker died mid-way) shows to a read_uncommitted reader only."""
    settings = exactly_once(settings, topic_partitions=1)
    await ensure_topics(settings)
    tp = TopicPartition(settings.topic_complaints, 0)
    outbox = TransactionalOutbox(settings, trace.get_tracer(__name__))
    await outbox.assigned({tp})
    producer = outbox._producers[tp]
    await producer.begin_transaction()
    await producer.send_and_wait(settings.topic_analysis, b"{}", key=b"half-done")
    await producer.abort_transaction()
    await outbox.close()
    seen = {}
    for isolation in ("read_uncommitted", "read_committed"):
        reader = AIOKafkaConsumer(**client_options(settings), isolation_level=isolation)
        await reader.start()
        try:
            out = TopicPartition(settings.topic_analysis, 0)
            reader.assign([out])
            await reader.seek_to_beginning(out)
            batch = await reader.getmany(out, timeout_ms=3000)
            seen[isolation] = [r.key for r in batch.get(out, [])]
        finally:
            await reader.stop()
    assert seen == {"read_uncommitted": [b"half-done"], "read_committed": []}


async def test_worker_killed_three_times_mid_batch_no_duplicate_for_read_committed(
    settings: Settings,
) -> None:
    """Exactly-once under crashes: a worker process is SIGKILLed mid-stream three times (no
    drain, no final commit, a transaction possibly open) and a new one started each time. Every
    document has exactly one answer for a read_committed reader, and the commits reach the end."""
    settings = exactly_once(settings, max_inflight=8, commit_interval_ms=300)
    await ensure_topics(settings)
    sent = await publish_documents(settings, good_documents(240))
    expected = {s.event_id for s in sent}
    env = child_env(settings, os.environ) | {"SCRIPTED_DELAY_S": "0.1", "PYTHONPATH": str(ROOT)}

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "tests.pipeline.worker"], cwd=ROOT, env=env)

    worker = start()
    try:
        for kill in range(3):
            goal = 40 * (kill + 1)
            seen = await collect_answers(settings, None, timeout_s=120, count=goal)
            assert sum(map(len, seen.values())) >= goal, f"kill {kill}: the worker never got that far"
            worker.send_signal(signal.SIGKILL)
            worker.wait()
            worker = start()
        answers = await collect_answers(settings, expected, timeout_s=180)
        ends = partition_ends(sent)
        for _ in range(50):
            if await committed_offsets(settings, set(ends)) == ends:
                break
            await asyncio.sleep(0.3)
        committed = await committed_offsets(settings, set(ends))
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert set(answers) == expected
    duplicates = Counter({e: len(found) for e, found in answers.items() if len(found) > 1})
    assert not duplicates, f"{sum(duplicates.values())} duplicates: {duplicates.most_common(3)}"
    assert committed == ends


async def test_kafkas_own_console_consumer_reads_the_answers_read_committed(
    settings: Settings, telemetry: Telemetry
) -> None:
    """An independent client: Apache Kafka's console consumer (from the same jars), reading the
    answer topic with isolation.level=read_committed, prints the analysis events a worker
    committed under exactly_once, one per document."""
    settings = exactly_once(settings)
    await ensure_topics(settings)
    sent = await publish_documents(settings, good_documents(6))
    service = Service(settings, ScriptedEngine(), telemetry)
    async with running(service, asyncio.Event()):
        await collect_answers(settings, {s.event_id for s in sent}, timeout_s=60)
    out = await asyncio.to_thread(
        run_tool,
        "org.apache.kafka.tools.consumer.ConsoleConsumer",
        "--bootstrap-server", settings.kafka_bootstrap_servers, "--topic", settings.topic_analysis,
        "--from-beginning", "--isolation-level", "read_committed", "--max-messages", str(len(sent)),
        "--timeout-ms", "30000",
    )  # fmt: skip
    events = [AnalysisEvent.model_validate_json(line) for line in out.splitlines() if line.strip()]
    assert sorted(e.event_id for e in events) == sorted(s.event_id for s in sent)
