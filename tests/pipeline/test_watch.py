"""The cluster as the worker sees it: lag on every input partition, topics that vanish or change
under it, and answers the broker refuses. About delivery, not the model: the stand-in engine."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from prometheus_client.parser import text_string_to_metric_families

from pipeline.client import collect_answers, publish_documents, publish_raw
from pipeline.http import serve_status
from pipeline.kafka import client_options, ensure_topics
from pipeline.kafka_broker import run_tool, unavailable_reason
from pipeline.service import Service, running
from pipeline.settings import Settings
from pipeline.telemetry import Telemetry
from schemas import DeadLetter, DeadLetterReason, DocumentEvent, DocumentKind
from tests.pipeline.fakes import ScriptedEngine

pytestmark = pytest.mark.integration


def quick(settings: Settings, **extra: object) -> Settings:
    return Settings(**{**settings.model_dump(), "cluster_check_interval_s": 0.3, **extra})


async def until(condition: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.2)


async def test_lag_counts_the_partitions_another_member_holds_and_never_reads(
    settings: Settings, telemetry: Telemetry
) -> None:
    """A second group member takes half the partitions and reads nothing. The worker's lag
    covered only its own partitions, so the unread ones showed lag 0; now every input partition
    is there, and the stuck ones show their backlog."""
    settings = quick(settings, topic_partitions=4)
    await ensure_topics(settings)
    stuck = AIOKafkaConsumer(
        *settings.input_topics, **client_options(settings), group_id=settings.consumer_group,
        session_timeout_ms=settings.session_timeout_ms, heartbeat_interval_ms=1_000,
    )  # fmt: skip
    await stuck.start()
    service = Service(settings, ScriptedEngine(), telemetry)
    try:
        async with running(service, asyncio.Event()):
            await until(lambda: service.is_ready and stuck.assignment() and service.consumer.assignment())
            await asyncio.sleep(1.0)  # let the rebalance settle
            docs = [
                DocumentEvent(document_id=f"d{i}", kind=DocumentKind.COMPLAINT, text=f"Lost {i}")
                for i in range(40)
            ]
            await publish_documents(settings, docs)
            theirs = {tp for tp in stuck.assignment() if tp.topic == settings.topic_complaints}
            assert theirs, "the stuck member holds no complaints partition"
            await until(lambda: all(service.lag().get(tp, 0) > 0 for tp in theirs))
            async with serve_status(service.status, "127.0.0.1", 0) as port, httpx.AsyncClient() as client:
                status = (await client.get(f"http://127.0.0.1:{port}/api/status")).json()
    finally:
        await stuck.stop()
    partitions = {f"{settings.topic_complaints}[{p}]" for p in range(4)}
    assert partitions <= status["consumer_lag"].keys()
    assert all(status["consumer_lag"][f"{tp.topic}[{tp.partition}]"] > 0 for tp in theirs)
    assert status["cluster"]["reachable"] is True


def consumer_groups_tool(settings: Settings) -> dict[tuple[str, int], tuple[int | None, int]]:
    """Apache Kafka's own `kafka-consumer-groups --describe` for the group (from the same jars):
    per partition, the committed offset (None: "-", nothing committed) and the log end offset."""
    out = run_tool(
        "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
        "--bootstrap-server", settings.kafka_bootstrap_servers,
        "--describe", "--group", settings.consumer_group,
    )  # fmt: skip
    lines = [line.split() for line in out.splitlines() if line.strip()]
    header = next(i for i, cols in enumerate(lines) if cols[:2] == ["GROUP", "TOPIC"])
    names = lines[header]
    rows = [dict(zip(names, cols, strict=False)) for cols in lines[header + 1 :]]
    return {
        (row["TOPIC"], int(row["PARTITION"])): (
            None if row["CURRENT-OFFSET"] == "-" else int(row["CURRENT-OFFSET"]),
            int(row["LOG-END-OFFSET"]),
        )
        for row in rows
        if row.get("PARTITION", "-").isdigit()
    }


@pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
async def test_lag_on_metrics_is_what_kafkas_own_consumer_groups_tool_reports(
    settings: Settings, telemetry: Telemetry
) -> None:
    """The worker's lag gauge against `kafka-consumer-groups`: on the partitions it answered
    (lag 0) and on those a second member holds and never reads (log end minus the commit, which
    the member made on one partition only; the tool shows "-" where nothing was committed, which
    the gauge counts from 0, as the group's `earliest` reset reads it)."""
    settings = quick(settings, topic_partitions=4)
    await ensure_topics(settings)
    stuck = AIOKafkaConsumer(
        *settings.input_topics, **client_options(settings), group_id=settings.consumer_group,
        session_timeout_ms=settings.session_timeout_ms, heartbeat_interval_ms=1_000, enable_auto_commit=False,
    )  # fmt: skip
    await stuck.start()
    service = Service(settings, ScriptedEngine(), telemetry)
    try:
        async with (
            running(service, asyncio.Event()),
            serve_status(service.status, "127.0.0.1", 0, service.metrics.render) as port,
            httpx.AsyncClient() as client,
        ):
            await until(lambda: service.is_ready and stuck.assignment() and service.consumer.assignment())
            await asyncio.sleep(1.0)  # let the rebalance settle
            docs = [
                DocumentEvent(document_id=f"d{i}", kind=DocumentKind.COMPLAINT, text=f"Lost {i}")
                for i in range(40)
            ]
            sent = await publish_documents(settings, docs)
            theirs = sorted(tp for tp in stuck.assignment() if tp.topic == settings.topic_complaints)
            assert theirs, "the stuck member holds no complaints partition"
            held = {
                tp: sum(1 for x in sent if (x.topic, x.partition) == (tp.topic, tp.partition))
                for tp in theirs
            }
            one = max(theirs, key=held.__getitem__)
            assert held[one] >= 2, held
            await stuck.commit({one: 1})
            ours = [tp for tp in service.consumer.assignment() if tp.topic == settings.topic_complaints]
            await until(lambda: all(service.lag().get(tp, 1) == 0 for tp in ours))
            await until(lambda: service.lag().get(one) == held[one] - 1)
            await asyncio.sleep(2 * settings.cluster_check_interval_s)  # the watch's next look
            text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
            tool = await asyncio.to_thread(consumer_groups_tool, settings)
    finally:
        await stuck.stop()
    gauge = {
        (sample.labels["topic"], int(sample.labels["partition"])): int(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "deepanalyze_consumer_lag"
    }
    complaints = {key: value for key, value in tool.items() if key[0] == settings.topic_complaints}
    assert len(complaints) == 4 and sum(end for _, end in complaints.values()) == 40
    for key, (committed, end) in complaints.items():
        assert gauge[key] == end - (committed or 0), (key, gauge[key], committed, end)
    assert any(gauge[key] > 0 for key in complaints) and any(gauge[key] == 0 for key in complaints)


async def test_a_vanished_topic_is_created_again_and_a_changed_one_is_reported(
    settings: Settings, telemetry: Telemetry
) -> None:
    """After a broker restart the first answer published created its topic with the broker's
    defaults. Now a topic that disappears is created again with TOPIC_PARTITIONS, and a topic
    whose partition count changed under the worker is named in /api/status."""
    settings = quick(settings)
    service = Service(settings, ScriptedEngine(), telemetry)
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        async with running(service, asyncio.Event()):
            await until(lambda: service.watch is not None and service.watch.view.partitions)
            await admin.delete_topics([settings.topic_dead_letters, settings.topic_analysis])
            view = service.watch.view  # type: ignore[union-attr]
            await until(lambda: settings.topic_dead_letters in view.recreated)
            await until(lambda: view.partitions.get(settings.topic_dead_letters) == settings.topic_partitions)
            assert not view.problems
            # Someone re-creates the answer topic with another partition count.
            await admin.delete_topics([settings.topic_analysis])
            await asyncio.sleep(0.05)
            await admin.create_topics([NewTopic(settings.topic_analysis, 5, 1)])
            await until(lambda: view.partitions.get(settings.topic_analysis) == 5, timeout_s=20)
            status = service.status()
    finally:
        await admin.close()
    assert status["cluster"]["partitions"][settings.topic_analysis] == 5
    assert any(settings.topic_analysis in problem for problem in status["cluster"]["problems"])


async def test_an_answer_the_broker_refuses_becomes_a_small_dead_letter_and_the_worker_goes_on(
    settings: Settings, telemetry: Telemetry
) -> None:
    """A dead letter larger than the producer (or topic) accepts was retried, turned fatal and
    stopped the worker, on every restart. Now the record gets a dead letter without its bytes
    (reason answer_rejected), and the next record is answered as usual."""
    settings = Settings(
        **{
            **settings.model_dump(),
            "max_message_bytes": 4 * 1024 * 1024,
            "dead_letter_max_value_bytes": 3 * 1024 * 1024,
        }
    )
    await ensure_topics(settings)
    big = await publish_raw(settings, settings.topic_complaints, b"\xff" * 900_000, key=b"big")
    after = await publish_documents(settings, [DocumentEvent(document_id="next", text="Refund please.")])
    service = Service(settings, ScriptedEngine(), telemetry)
    async with running(service, asyncio.Event()) as task:
        answers = await collect_answers(settings, {big.event_id, after[0].event_id}, timeout_s=60)
        assert not task.done(), "the worker stopped"
    letter = answers[big.event_id][0]
    assert isinstance(letter, DeadLetter) and letter.error_type is DeadLetterReason.ANSWER_REJECTED
    assert not letter.value_b64 and letter.value_truncated  # the original stays at its coordinates
    assert letter.value_bytes == 900_000 and letter.value_sha256
    assert after[0].event_id in answers
