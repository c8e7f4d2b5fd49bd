"""The whole delivery path over a real broker: every record answered once, offsets committed,
restarts lose nothing, one trace per document."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import httpx
import psutil
import pytest
from aiokafka.structs import TopicPartition
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from pipeline.bundled_models import MODELS
from pipeline.client import Sent, collect_answers, publish_documents, publish_raw
from pipeline.http import serve_status
from pipeline.kafka import ensure_topics, make_consumer
from pipeline.service import Service, label_policy, running
from pipeline.settings import Settings, child_env
from pipeline.telemetry import Telemetry
from schemas import AnalysisEvent, DeadLetter, DeadLetterReason, DocumentEvent, DocumentKind, Language
from tests.deploy.promql import SCRAPE_SERIES, TARGET_LABELS, queries, reads
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
            assert (answer.kind == DocumentKind.COMPLAINT) == (answer.analysis.triage is not None)
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
    # Every distinct narrative grammar (one per language: the built-in kinds share theirs) was
    # prepared once, ahead of need, and the status says so.
    assert sorted(engine.prepared) == sorted({p.json_schema for p in service.analyzer.params.values()})
    assert len(engine.prepared) == len(Language) and service.grammars_ready
    # Committed offsets equal the end of every input partition.
    all_sent = sent + [_sent_of(a[0]) for e, a in answers.items() if e in bad]
    ends = partition_ends(all_sent)
    assert await committed_offsets(settings, set(ends)) == ends


def _sent_of(letter: AnalysisEvent | DeadLetter) -> Sent:
    source = letter.source
    return Sent("", source.topic, source.partition, source.offset, letter.event_id)


async def test_two_workers_one_killed_mid_batch_lose_nothing(settings: Settings) -> None:
    """Pipeline delivery under a crash, so the analyser is the fast stand-in (`ScriptedEngine`):
    two worker processes share the group's partitions, one is SIGKILLed mid-batch (no drain, no
    final commit); the survivor takes its partitions over, every document gets exactly one
    event id, the committed offsets reach the end, and SIGTERM stops the survivor cleanly."""
    settings = Settings(**{**settings.model_dump(), "max_inflight": 4, "commit_interval_ms": 300})
    await ensure_topics(settings)
    sent = await publish_documents(settings, good_documents(200))
    expected = {s.event_id for s in sent}
    env = child_env(settings, os.environ) | {"SCRIPTED_DELAY_S": "0.2", "PYTHONPATH": str(ROOT)}
    workers = [
        subprocess.Popen([sys.executable, "-m", "tests.pipeline.worker"], cwd=ROOT, env=env) for _ in range(2)
    ]
    try:
        early = await collect_answers(settings, None, timeout_s=90, count=30)
        assert sum(map(len, early.values())) >= 30, "the workers never answered"
        workers[0].send_signal(signal.SIGKILL)  # a crash: in-flight work lost, nothing committed
        workers[0].wait()
        at_kill = sum(map(len, (await collect_answers(settings, None, timeout_s=1)).values()))
        assert at_kill < len(expected), "the crash came too late to be mid-stream"

        answers = await collect_answers(settings, expected, timeout_s=120)
        ends = partition_ends(sent)
        for _ in range(50):  # the survivor commits every 300 ms
            if await committed_offsets(settings, set(ends)) == ends:
                break
            await asyncio.sleep(0.2)
        assert await committed_offsets(settings, set(ends)) == ends
        workers[1].send_signal(signal.SIGTERM)
        assert workers[1].wait(timeout=30) == 0
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()

    assert set(answers) == expected  # nothing lost, nothing unexpected
    by_document: dict[str, set[str]] = defaultdict(set)
    for event_id, found in answers.items():
        for answer in found:
            assert isinstance(answer, AnalysisEvent)
            by_document[answer.document_id].add(event_id)
    # Re-deliveries after the crash are duplicates of the same event, never a new id.
    assert all(len(ids) == 1 for ids in by_document.values())
    assert len(by_document) == len(sent)


async def test_workers_option_runs_a_group_of_processes_that_stop_cleanly(settings: Settings) -> None:
    """`--workers N`'s supervisor, with the stand-in worker (this is about processes, not the model)."""
    await ensure_topics(settings)
    sent = await publish_documents(settings, good_documents(40))
    code = (
        "import asyncio, sys; from pipeline.workers import supervise; "
        "sys.exit(asyncio.run(supervise(2, [sys.executable, '-m', 'tests.pipeline.worker'])))"
    )
    env = child_env(settings, os.environ) | {
        "SCRIPTED_DELAY_S": "0.05",
        "PYTHONPATH": str(ROOT),
        "STATUS_PORT": "0",
    }
    supervisor = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env)
    try:
        answers = await collect_answers(settings, {s.event_id for s in sent}, timeout_s=90)
        children = psutil.Process(supervisor.pid).children()
        assert len(children) == 2
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=30) == 0
        assert not any(child.is_running() and child.status() != psutil.STATUS_ZOMBIE for child in children)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
    assert len(answers) == len(sent)


async def test_backpressure_bounds_in_flight_documents_and_pauses_fetching(
    settings: Settings, telemetry: Telemetry
) -> None:
    settings = Settings(**{**settings.model_dump(), "max_inflight": 3})
    await ensure_topics(settings)
    sent = await publish_documents(settings, good_documents(40))
    engine = ScriptedEngine(delay_s=0.05)
    service = Service(settings, engine, telemetry)
    paused_seen = False
    async with running(service, asyncio.Event()):
        collecting = asyncio.create_task(collect_answers(settings, {s.event_id for s in sent}, timeout_s=60))
        while not collecting.done():
            status = service.status()
            assert status["in_flight"] <= settings.max_inflight
            paused_seen |= status["paused"] and bool(service.consumer.paused())
            await asyncio.sleep(0.01)
        answers = collecting.result()
    assert len(answers) == len(sent)
    assert engine.max_concurrent == settings.max_inflight  # the bound was reached, never passed
    assert paused_seen


async def test_one_trace_per_document(
    settings: Settings, telemetry: Telemetry, span_exporter: InMemorySpanExporter
) -> None:
    await ensure_topics(settings)
    tracer = telemetry.tracer
    documents = good_documents(3)
    roots, root_spans = {}, {}
    span_exporter.clear()
    for document in documents:
        with tracer.start_as_current_span(f"submit {document.document_id}") as root:
            await publish_documents(settings, [document], tracer=tracer)
            roots[document.document_id] = root.get_span_context().trace_id
            root_spans[document.document_id] = root.get_span_context().span_id
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
        publish = by_name[f"send {settings.topic_analysis}"]
        assert process.kind is trace.SpanKind.CONSUMER
        assert process.attributes["messaging.system"] == "kafka"
        assert process.attributes["messaging.destination.name"] == event.source.topic
        assert process.attributes["messaging.destination.partition.id"] == str(event.source.partition)
        assert process.attributes["messaging.consumer.group.name"] == settings.consumer_group
        assert process.attributes["messaging.batch.message_count"] >= 1
        assert publish.kind is trace.SpanKind.PRODUCER
        assert publish.attributes["messaging.system"] == "kafka"
        assert publish.attributes["messaging.destination.name"] == settings.topic_analysis
        assert publish.attributes["messaging.destination.partition.id"] is not None
        # consume -> analyze -> publish hang under the document's process span ...
        assert analyze.parent.span_id == process.context.span_id
        assert publish.parent.span_id == process.context.span_id
        # One CONSUMER and two PRODUCER spans (the document's, the answer's) per trace: no others.
        kinds = [s.kind for s in in_trace]
        assert kinds.count(trace.SpanKind.CONSUMER) == 1 and kinds.count(trace.SpanKind.PRODUCER) == 2
        # ... the engine's phases under analyze, with gen_ai attributes ...
        chat = by_name["chat scripted"]
        assert by_name["queue_wait"].parent.span_id == analyze.context.span_id
        assert chat.attributes["gen_ai.request.model"] == "scripted"
        assert chat.attributes["gen_ai.provider.name"] == "deepanalyze"
        assert chat.attributes["gen_ai.operation.name"] == "chat"
        assert chat.attributes["gen_ai.usage.output_tokens"] > 0
        assert chat.attributes["deepanalyze.engine.batch_size"] == 1
        for phase in ("prefill", "decode"):
            assert by_name[phase].parent.span_id == chat.context.span_id
            assert chat.start_time <= by_name[phase].start_time <= by_name[phase].end_time <= chat.end_time
        usage = [s.name for s in in_trace if any(k.startswith("gen_ai.usage") for k in s.attributes or {})]
        assert usage == [chat.name]  # token usage once, on the chat span
        # ... which continues the producer's context from the record headers.
        producer_send = by_name[f"send {event.source.topic}"]
        assert producer_send.parent.span_id == root_spans[event.document_id]
        assert process.parent.span_id == producer_send.context.span_id


async def test_metrics_endpoint_exposes_latency_batches_queue_kv_lag_and_dead_letters(
    settings: Settings, telemetry: Telemetry
) -> None:
    settings = Settings(**{**settings.model_dump(), "max_document_chars": 4000})  # as publish_bad expects
    await ensure_topics(settings)
    sent = await publish_documents(settings, good_documents(4))
    bad = await publish_bad(settings)
    service = Service(settings, ScriptedEngine(), telemetry)
    async with (
        running(service, asyncio.Event()),
        serve_status(service.status, "127.0.0.1", 0, service.metrics.render) as port,
        httpx.AsyncClient() as client,
    ):
        await collect_answers(settings, {s.event_id for s in sent} | set(bad), timeout_s=60)
        await asyncio.sleep(0.5)  # the last commits
        response = await client.get(f"http://127.0.0.1:{port}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = list(text_string_to_metric_families(response.text))
    assert all(f.documentation for f in families), [f.name for f in families if not f.documentation]
    labels_of: dict[str, set[str]] = defaultdict(set)
    for family in families:
        for sample in family.samples:
            labels_of[sample.name] |= set(sample.labels)
    assert not any(label.startswith("otel_") for labels in labels_of.values() for label in labels)
    samples = {
        (
            sample.name,
            tuple(sorted((k, v) for k, v in sample.labels.items() if not k.startswith("otel_"))),
        ): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }
    names = {name for name, _ in samples}

    def value(name: str, **labels: str) -> float:
        return samples[name, tuple(sorted(labels.items()))]

    assert value("deepanalyze_documents_total", outcome="analysis") == len(sent)
    assert value("deepanalyze_documents_total", outcome="dead_letter") == len(bad)
    for reason in set(bad.values()):
        expected = sum(1 for r in bad.values() if r is reason)
        assert value("deepanalyze_dead_letters_total", reason=reason.value) == expected
    assert value("deepanalyze_document_duration_seconds_count", outcome="analysis") == len(sent)
    assert value("deepanalyze_time_to_first_token_seconds_count", kind="complaint") >= 1
    assert "deepanalyze_engine_batch_size_bucket" in names
    for gauge in ("deepanalyze_engine_queue_depth", "deepanalyze_in_flight", "deepanalyze_kv_pool_used_bytes",
                  "deepanalyze_kv_pool_total_bytes"):  # fmt: skip
        assert gauge in names
    lags = {labels: v for (name, labels), v in samples.items() if name == "deepanalyze_consumer_lag"}
    assert len(lags) == len(settings.input_topics) * settings.topic_partitions
    assert all(v == 0 for v in lags.values())  # everything answered and committed
    # Serving metrics as counters and histograms, like vLLM's, and the process's own.
    assert (
        value("deepanalyze_tokens_total", type="input") > value("deepanalyze_tokens_total", type="output") > 0
    )
    assert value("deepanalyze_time_per_output_token_seconds_count", kind="complaint") >= 1
    assert value("deepanalyze_engine_generated_tokens_total") > 0
    for total in ("prefix_cache_hit_tokens", "preemptions", "steps", "accepted_draft_tokens"):
        assert f"deepanalyze_engine_{total}_total" in names
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes"} <= names
    # Every series and label the Grafana dashboard and the alert rules query is in this scrape.
    for where, expr in queries().items():
        for read in reads(expr):
            if read.metric in SCRAPE_SERIES:
                continue
            assert read.metric in labels_of, f"{where}: no series {read.metric}"
            assert read.labels - TARGET_LABELS <= labels_of[read.metric], f"{where}: {read}"


async def test_the_startup_heap_is_frozen_before_consuming(settings: Settings, telemetry: Telemetry) -> None:
    """Imports, model and engine are out of the collector's sight once the worker consumes: a full
    collection over them took 90 ms in a worker (the pipeline benchmark's latency tail)."""
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    service = Service(settings, ScriptedEngine(), telemetry)
    async with running(service, asyncio.Event()):
        while not service.is_ready:  # noqa: ASYNC110 (a plain attribute, no event to wait on)
            await asyncio.sleep(0.01)
        assert gc.get_freeze_count() > 10_000  # this process has torch and the whole suite loaded


def test_the_label_policy_carries_the_bundled_model_s_prior_and_none_for_a_model_path(
    settings: Settings, tmp_path: Path
) -> None:
    for name, model in MODELS.items():
        bundled = Settings(**{**settings.model_dump(), "model": name, "model_path": None})
        assert label_policy(bundled).polarity_prior == model.polarity_prior
    assert any(m.polarity_prior for m in MODELS.values())
    elsewhere = Settings(**{**settings.model_dump(), "model_path": tmp_path})
    assert label_policy(elsewhere).polarity_prior == {}


def test_the_label_policy_reads_polarity_with_the_bundled_probe_unless_told_otherwise(
    settings: Settings, tmp_path: Path
) -> None:
    default = Settings(**{**settings.model_dump(), "model_path": None, "polarity_from": "probe"})
    probe = label_policy(default).probe
    assert probe is not None and probe.covers("zh") and probe.covers("en")
    assert label_policy(default).polarity_questions == ()  # the question is then not asked
    parts = Settings(**{**default.model_dump(), "polarity_parts": 3})
    assert (label_policy(default).polarity_parts, label_policy(parts).polarity_parts) == (1, 3)
    off = Settings(**{**default.model_dump(), "polarity_guard_parts": 1})
    assert (label_policy(default).guard_parts, label_policy(off).guard_parts) == (3, 1)
    asked = Settings(**{**default.model_dump(), "polarity_from": "question"})
    assert label_policy(asked).probe is None and label_policy(asked).polarity_questions == ("polarity",)
    elsewhere = Settings(**{**default.model_dump(), "model_path": tmp_path})
    assert label_policy(elsewhere).probe is None  # a probe belongs to one model's weights
    own = tmp_path / "probe.json"
    probe.write(own)
    assert label_policy(Settings(**{**elsewhere.model_dump(), "polarity_probe": own})).probe == probe
    with pytest.raises(ValueError, match="POLARITY_PROBE"):
        Settings(**{**elsewhere.model_dump(), "polarity_probe": tmp_path / "missing.json"})
    with pytest.raises(ValueError, match="ANALYZER_BACKEND=embedded"):
        Settings(**{**default.model_dump(), "polarity_probe": own, "analyzer_backend": "openai",
                    "openai_base_url": "http://127.0.0.1:1/v1"})  # fmt: skip
