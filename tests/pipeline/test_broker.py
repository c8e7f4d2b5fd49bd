"""The broker the project starts for itself: Apache Kafka from the pinned jars, its data kept on
disk across a restart, gone with the process that started it; where Java or the jars are
missing, the Tansu fallback, with the reason said."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from pipeline.broker import BrokerError, chosen_kind, embedded_broker
from pipeline.client import publish_documents
from pipeline.kafka import client_options, ensure_topics
from pipeline.kafka_broker import KAFKA_VERSION, KafkaCluster, new_cluster_id, unavailable_reason
from pipeline.settings import Settings, load_settings
from schemas import DocumentEvent, DocumentKind

ROOT = Path(__file__).resolve().parents[2]
needs_kafka = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def test_the_pom_resolves_the_version_the_code_starts() -> None:
    pom = ET.parse(ROOT / "deploy" / "kafka" / "pom.xml").getroot()  # noqa: S314 - our own file
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    assert pom.findtext("m:properties/m:kafka.version", namespaces=ns) == KAFKA_VERSION


def test_without_the_jars_the_fallback_is_tansu_and_the_reason_is_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KAFKA_LIBS", str(tmp_path))
    monkeypatch.delenv("EMBEDDED_BROKER", raising=False)
    with caplog.at_level(logging.WARNING, logger="pipeline.broker"):
        assert chosen_kind() == "tansu"
    assert f"Apache Kafka {KAFKA_VERSION} jars are not in {tmp_path}" in caplog.text
    monkeypatch.setenv("EMBEDDED_BROKER", "kafka")  # insisting on Kafka is an error, not a fallback
    with pytest.raises(BrokerError, match="jars are not in"), embedded_broker():
        pass


@pytest.mark.integration
@needs_kafka
async def test_records_and_committed_offsets_survive_a_restart(tmp_path: Path) -> None:
    """A stop and a start keep topics, records and the group's committed offsets (the emulator
    came back empty)."""
    with embedded_broker(kind="kafka", folder=tmp_path) as broker:
        assert broker.durable
        run = uuid.uuid4().hex[:8]
        settings = load_settings(
            kafka_bootstrap_servers=broker.bootstrap_servers, topic_partitions=1, consumer_group=f"g{run}"
        )
        await ensure_topics(settings)
        docs = [DocumentEvent(document_id=f"r{i}", kind=DocumentKind.FILING, text=f"Q{i}") for i in range(5)]
        sent = await publish_documents(settings, docs)
        tp = TopicPartition(settings.topic_filings, 0)
        await _commit(settings, tp, 3)
        broker.stop()
        broker.start()
        reader = AIOKafkaConsumer(
            **client_options(settings), enable_auto_commit=False, group_id=settings.consumer_group
        )
        await reader.start()
        try:
            reader.assign([tp])
            committed = None
            for _ in range(100):  # the coordinator answers "none" while it loads the offsets again
                if (committed := await reader.committed(tp)) is not None:
                    break
                await asyncio.sleep(0.2)
            await reader.seek_to_beginning(tp)
            records = await reader.getmany(tp, timeout_ms=10_000)
        finally:
            await reader.stop()
    assert committed == 3
    assert [r.offset for r in records[tp]] == [s.offset for s in sent] == [0, 1, 2, 3, 4]
    assert [json.loads(r.value)["document_id"] for r in records[tp]] == [d.document_id for d in docs]


async def _commit(settings: Settings, tp: TopicPartition, offset: int) -> None:
    consumer = AIOKafkaConsumer(
        **client_options(settings), group_id=settings.consumer_group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.commit({tp: OffsetAndMetadata(offset, "")})
    finally:
        await consumer.stop()


@pytest.mark.integration
@needs_kafka
def test_the_broker_does_not_outlive_the_process_that_started_it() -> None:
    """A test run or a demo killed with SIGKILL cannot stop its broker; the JVM goes with it."""
    script = (
        "import time\n"
        "from pipeline.broker import embedded_broker\n"
        "with embedded_broker(kind='kafka') as broker:\n"
        "    print(broker.nodes[0].process.pid, flush=True)\n"
        "    time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert parent.stdout is not None
    line = parent.stdout.readline()
    assert line.strip().isdigit(), f"the broker did not start: {line!r}"
    jvm = int(line)
    parent.kill()
    parent.wait()
    parent.stdout.close()
    deadline = time.monotonic() + 15
    while _alive(jvm):
        assert time.monotonic() < deadline, f"the broker's JVM {jvm} outlived its parent"
        time.sleep(0.2)


def test_a_new_cluster_id_never_begins_with_a_dash() -> None:
    """One url-safe id in 64 begins with "-", which `kafka-storage format` reads as an option (a CI
    run failed on it); 4,096 draws would meet one with certainty short of 1 - e^-64."""
    ids = [new_cluster_id() for _ in range(4096)]
    assert not [i for i in ids if i.startswith("-")]
    assert {len(i) for i in ids} == {22}


@pytest.mark.integration
@needs_kafka
def test_a_cluster_whose_id_begins_with_a_dash_formats_and_starts(tmp_path: Path) -> None:
    """Ids are kept on disk across restarts, and one written by another tool may begin with "-";
    the format command passes it as `--cluster-id=<id>`, which cannot be read as an option."""
    cluster = KafkaCluster(tmp_path, cluster_id="-wp1_dZBTyGSTavBF7bC2Q")
    try:
        cluster.start()
        meta = (tmp_path / "node-1" / "data" / "meta.properties").read_text()
        assert "cluster.id=-wp1_dZBTyGSTavBF7bC2Q" in meta
    finally:
        cluster.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie waiting for init to reap it is gone
        return stat.read().split()[2] != "Z"
