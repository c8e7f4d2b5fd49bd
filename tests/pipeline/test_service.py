"""The whole delivery path over a real broker: every record answered once, offsets committed,
restarts lose nothing, one trace per document."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from aiokafka.structs import TopicPartition
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pipeline.client import Sent, collect_answers, publish_documents, publish_raw
from pipeline.kafka import ensure_topics, make_consumer
from pipeline.service import Service, running
from pipeline.settings import Settings
from pipeline.telemetry import Telemetry
from schemas import AnalysisEvent, DeadLetter, DeadLetterReason, DocumentEvent, DocumentKind
from tests.pipeline.fakes import ScriptedEngine

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def good_documents(n: int) -> list[DocumentEvent]:
    kinds = list(DocumentKind)
    texts = [
        "快递晚到了五天，还多收了安装费。",
        "Revenue grew 9% to $2.8 billion.",
        "会议决定下周上线新版本。",
    ]
    return [
        DocumentEvent(document_id=f"doc-{i}", kind=kinds[i % 3], text=f"{texts[i % 3]} #{i}")
        for i in range(n)
    ]


async def publish_bad(settings: Settings) -> dict[str, DeadLetterReason]:
    """One record per malformed case; returns event id -> expected reason."""
    cases = [
        (settings.topic_complaints, b"\xff\xfe not utf-8", [], DeadLetterReason.NOT_UTF8),
        (
            settings.topic_filings,
            b'{"text": "unclosed',
            [("content-type", b"application/json")],
            DeadLetterReason.INVALID_JSON,
        ),
        (settings.topic_meeting_notes, b'{"body": "no text field"}', [], DeadLetterReason.SCHEMA_VIOLATION),
        (settings.topic_complaints, b"   \n  ", [], DeadLetterReason.EMPTY_TEXT),
        (
            settings.topic_filings,
            b'{"text": "x"}' + b" " * 10 + ("长" * 5000).encode(),
            [("content-type", b"text/plain")],
            DeadLetterReason.TOO_LONG,
        ),
        (
            settings.topic_complaints,
            b"MODEL-FAIL this complaint makes the model babble",
            [],
            DeadLetterReason.MODEL_OUTPUT_INVALID,
        ),
    ]
    expected = {}
    for i, (topic, value, headers, reason) in enumerate(cases):
        sent = await publish_raw(settings, topic, value, key=f"bad-{i}".encode(), headers=headers)
        expected[sent.event_id] = reason
    return expected


async def committed_offsets(
    settings: Settings, partitions: set[TopicPartition]
) -> dict[TopicPartition, int | None]:
    consumer = make_consumer(settings)
    await consumer.start()
    try:
        return {tp: await consumer.committed(tp) for tp in partitions}
    finally:
        await consumer.stop()


def partition_ends(sent: list[Sent]) -> dict[TopicPartition, int]:
    ends: dict[TopicPartition, int] = {}
    for s in sent:
        tp = TopicPartition(s.topic, s.partition)
        ends[tp] = max(ends.get(tp, 0), s.offset + 1)
    return ends


async def test_every_record_answered_once_and_committed(settings: Settings, telemetry: Telemetry) -> None:
    settings = Settings(**{**settings.model_dump(), "max_document_chars": 4000})
    await ensure_topics(settings)
    documents = [
        *good_documents(24),
        DocumentEvent(
            document_id="doc-repair", kind=DocumentKind.FILING, text="MODEL-REPAIR needs a second attempt"
        ),
    ]
    sent = await publish_documents(settings, documents)
    bad = await publish_bad(settings)
    expected_good = {s.event_id: s for s in sent}
    engine = ScriptedEngine()
    service = Service(settings, engine, telemetry)
    async with running(service, asyncio.Event()):
        answers = await collect_answers(settings, set(expected_good) | set(bad), timeout_s=60)
        await asyncio.sleep(0.5)  # let the last commit land

    assert set(answers) == set(expected_good) | set(bad)
    for event_id, found in answers.items():
        assert len({a.model_dump_json(exclude={"created_at", "timings"}) for a in found}) == 1
        answer = found[0]
        if event_id in expected_good:
            assert isinstance(answer, AnalysisEvent), answer
            assert answer.document_id == expected_good[event_id].document_id
            assert (answer.kind is DocumentKind.COMPLAINT) == (answer.analysis.triage is not None)
            AnalysisEvent.model_validate_json(answer.model_dump_json())
        else:
            assert isinstance(answer, DeadLetter), answer
            assert answer.error_type is bad[event_id]
            assert answer.value_b64 is not None
    repaired = next(a[0] for a in answers.values() if a[0].document_id == "doc-repair")
    assert isinstance(repaired, AnalysisEvent) and repaired.timings.attempts == 2
    failed = next(a[0] for a in answers.values() if isinstance(a[0], DeadLetter) and a[0].attempts)
    assert failed.raw_model_output is not None and failed.attempts == settings.generation_attempts

    assert service.counters.processed == len(expected_good)
    assert service.counters.dead_lettered == len(bad)
    # Committed offsets equal the end of every input partition.
    all_sent = sent + [_sent_of(a[0]) for e, a in answers.items() if e in bad]
    ends = partition_ends(all_sent)
    assert await committed_offsets(settings, set(ends)) == ends


def _sent_of(letter: AnalysisEvent | DeadLetter) -> Sent:
    return Sent("", letter.source.topic, letter.source.partition, letter.source.offset)


def _settings_env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "TOPIC_", "DYNAMIC_", "MAX_"))}
    for name, value in settings.model_dump().items():
        if value is not None and not isinstance(value, dict | list):
            env[name.upper()] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


async def test_crash_mid_stream_loses_nothing(settings: Settings, telemetry: Telemetry) -> None:
    settings = Settings(**{**settings.model_dump(), "max_inflight": 2, "commit_interval_ms": 500})
    await ensure_topics(settings)
    sent = await publish_documents(settings, good_documents(30))
    expected = {s.event_id for s in sent}
    env = _settings_env(settings) | {"SCRIPTED_DELAY_S": "0.25", "PYTHONPATH": str(ROOT)}
    worker = subprocess.Popen([sys.executable, "-m", "tests.pipeline.worker"], cwd=ROOT, env=env)
    try:
        early = await collect_answers(settings, None, timeout_s=90, count=8)
        assert sum(map(len, early.values())) >= 8, "the first worker never answered"
    finally:
        worker.send_signal(signal.SIGKILL)  # a crash: no drain, no final commit
        worker.wait()
    killed_answers = sum(map(len, (await collect_answers(settings, None, timeout_s=2)).values()))
    assert killed_answers < len(expected), "the crash came too late to be mid-stream"

    service = Service(settings, ScriptedEngine(), telemetry)
    async with running(service, asyncio.Event()):
        answers = await collect_answers(settings, expected, timeout_s=60)
        await asyncio.sleep(0.5)

    assert set(answers) == expected  # nothing lost, nothing unexpected
    by_document: dict[str, set[str]] = defaultdict(set)
    for event_id, found in answers.items():
        for answer in found:
            assert isinstance(answer, AnalysisEvent)
            by_document[answer.document_id].add(event_id)
    # Re-deliveries after the crash are duplicates of the same event, never a new id.
    assert all(len(ids) == 1 for ids in by_document.values())
    assert len(by_document) == len(sent)
    ends = partition_ends(sent)
    assert await committed_offsets(settings, set(ends)) == ends


async def test_one_trace_per_document(
    settings: Settings, telemetry: Telemetry, span_exporter: InMemorySpanExporter
) -> None:
    await ensure_topics(settings)
    tracer = telemetry.tracer
    documents = good_documents(3)
    roots = {}
    span_exporter.clear()
    for document in documents:
        with tracer.start_as_current_span(f"submit {document.document_id}") as root:
            await publish_documents(settings, [document])
            roots[document.document_id] = root.get_span_context().trace_id
    service = Service(settings, ScriptedEngine(), telemetry)
    async with running(service, asyncio.Event()):
        answers = await collect_answers(settings, None, timeout_s=60, count=3)
    spans = span_exporter.get_finished_spans()
    for found in answers.values():
        event = found[0]
        assert isinstance(event, AnalysisEvent)
        trace_id = roots[event.document_id]
        assert event.trace_id == format(trace_id, "032x")
        in_trace = [s for s in spans if s.context.trace_id == trace_id]
        by_name = {s.name: s for s in in_trace}
        process = by_name[f"process {event.source.topic}"]
        analyze = by_name["analyze"]
        publish = by_name[f"{settings.topic_analysis} send"]
        assert process.kind is trace.SpanKind.CONSUMER
        assert process.attributes["messaging.system"] == "kafka"
        assert process.attributes["messaging.destination.partition.id"] == str(event.source.partition)
        # consume -> analyze -> publish hang under the document's process span ...
        assert analyze.parent.span_id == process.context.span_id
        assert publish.parent.span_id == process.context.span_id
        assert {"queue_wait", "chat scripted"} <= by_name.keys()
        assert by_name["chat scripted"].attributes["gen_ai.usage.output_tokens"] > 0
        # ... which continues the producer's context from the record headers.
        producer_send = by_name[f"{event.source.topic} send"]
        assert process.parent.span_id == producer_send.context.span_id
