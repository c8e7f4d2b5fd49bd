"""Faults, counted: the pipeline on a 3-node Apache Kafka (KRaft) cluster on loopback, replication
factor 3, min.insync.replicas 2, acks=all, while things break.

Scenarios (each with topics and a consumer group of its own, documents published at a steady
rate while the fault happens about a third of the way in):
- `input-leader-kill`: kill -9 the broker leading an input partition, start it again later;
- `output-leader-kill`: kill -9 the broker leading a partition of the analysis topic, start it again;
- `broker-restart`: stop one broker (SIGTERM), start it again with its data;
- `worker-kill`: kill -9 the worker mid-batch `--worker-kills` times, a new one started each time;
- `rebalance`: a second worker joins mid-stream and leaves again (SIGTERM).

For each, under each `--guarantees`: documents sent, answers (analysis events and dead letters,
distinct event ids) read by a `read_committed` reader, lost (sent but never answered: must be 0)
and duplicates (answers beyond the first per event id; with exactly_once they must be 0). The
analyser is the instant stand-in (`bench/pipeline_worker.py`) unless `--real-model`: then the
worker runs the default model on a few documents. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import TopicPartition
from rich.console import Console
from rich.table import Table

from bench.common import stop_process, worker_env
from bench.pipeline_bench import TEXTS
from pipeline.client import answer_id
from pipeline.kafka import client_options, ensure_topics, partitions_of
from pipeline.kafka_broker import KafkaCluster, kafka_cluster
from pipeline.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("input-leader-kill", "output-leader-kill", "broker-restart", "worker-kill", "rebalance")


@dataclass
class Outcome:
    scenario: str
    guarantee: str
    analyser: str
    sent: int
    answered: int  # distinct event ids answered (analysis events + dead letters)
    analysis_events: int
    dead_letters: int
    lost: int
    duplicates: int  # answers beyond the first per event id, as a read_committed reader sees them
    fault: str
    seconds: float
    missing: list[str]  # the documents lost, by id, each with where it went missing (`diagnose`)


@dataclass(frozen=True)
class Sent:
    """A published document: its index (document id `d<index>`) and where the broker put it."""

    index: int
    topic: str
    partition: int
    offset: int


class Workers:
    """Worker processes of one scenario (`bench.pipeline_worker`, or the real one)."""

    def __init__(self, settings: Settings, real_model: bool, logs: Path) -> None:
        self.settings = settings
        self.real_model = real_model
        self.logs = logs
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self) -> subprocess.Popen[bytes]:
        module = "pipeline" if self.real_model else "bench.pipeline_worker"
        args = [sys.executable, "-m", module] + (["run"] if self.real_model else [])
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(
            self.logs / f"{self.settings.consumer_group}-worker-{len(self.processes)}.log", "wb"
        ) as log:
            process = subprocess.Popen(args, cwd=ROOT, env=worker_env(self.settings), stderr=log)
        self.processes.append(process)
        return process

    def kill(self, process: subprocess.Popen[bytes]) -> None:
        process.kill()
        process.wait()

    def stop(self, process: subprocess.Popen[bytes]) -> None:
        stop_process(process, 90)

    def stop_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                self.stop(process)


def scenario_settings(servers: str, guarantee: str, real_model: bool) -> Settings:
    run = uuid.uuid4().hex[:8]
    extra: dict[str, Any] = {} if real_model else {"max_inflight": 64}
    if real_model:
        extra |= {"dynamic_batching": True, "max_batch_size": 4, "shutdown_grace_s": 5.0}
    return load_settings(
        kafka_bootstrap_servers=servers, consumer_group=f"faults-{run}", topic_partitions=3,
        topic_replication_factor=3, topic_complaints=f"f{run}.complaints", topic_meeting_notes=f"f{run}.notes",
        topic_filings=f"f{run}.filings", topic_analysis=f"f{run}.analysis", topic_dead_letters=f"f{run}.dlq",
        commit_interval_ms=500, status_port=0, processing_guarantee=guarantee, session_timeout_ms=6_000,
        **extra,
    )  # fmt: skip


def checkpoints(n: int) -> range:
    """Where publishing `n` documents waits for its pace and looks at the fault schedule: every 10
    documents in volume runs, at each one in small ones (so that the faults of a 6-document run
    with the real model happen at a third and two thirds, not never)."""
    return range(0, n, max(1, min(10, n // 20)))


async def publish(
    settings: Settings, n: int, rate: float, at_fraction: Callable[[float], Awaitable[None]]
) -> dict[str, Sent]:
    """Publishes `n` documents at `rate`/s (acks=all, idempotent), calling `at_fraction(f)` as the
    share f of them is sent; returns event id -> what was sent where."""
    producer = AIOKafkaProducer(**client_options(settings), acks="all", enable_idempotence=True, linger_ms=5)
    await producer.start()
    rng, topics, sent = random.Random(n), list(settings.input_topics), {}
    start, futures, values = time.perf_counter(), [], []
    try:
        paced = set(checkpoints(n))
        for i in range(n):
            if i in paced:
                await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
                await at_fraction(i / n)
            value = json.dumps({"document_id": f"d{i}", "text": f"{rng.choice(TEXTS)} #{i}"}).encode()
            now_ms = int(time.time() * 1000)
            values.append((value, now_ms))
            futures.append(await producer.send(rng.choice(topics), value, timestamp_ms=now_ms,
                                               headers=[("content-type", b"application/json")]))  # fmt: skip
        acks = await asyncio.gather(*futures)
    finally:
        await producer.stop()
    for i, (meta, (value, now_ms)) in enumerate(zip(acks, values, strict=True)):
        sent[answer_id(meta, value, now_ms, append_time=False)] = Sent(
            i, meta.topic, meta.partition, meta.offset
        )
    return sent


async def collect(
    settings: Settings, expected: set[str], timeout_s: float, quiet_s: float
) -> tuple[Counter[str], dict[str, str]]:
    """Answers per event id and each id's kind (analysis or dead_letter), read with read_committed
    from both answer topics, until every expected id has one and nothing new came for `quiet_s`
    (duplicates arrive late), or the timeout."""
    found = await partitions_of(settings, [settings.topic_analysis, settings.topic_dead_letters])
    partitions = [TopicPartition(t, p) for t, ps in found.items() for p in ps]
    # earliest: a fetch position out of range during a leader change re-reads instead of jumping
    # to the end (aiokafka's default), and re-read records are counted once, by their coordinates.
    consumer = AIOKafkaConsumer(
        **client_options(settings), isolation_level="read_committed", auto_offset_reset="earliest"
    )
    await consumer.start()
    counts: Counter[str] = Counter()
    kinds: dict[str, str] = {}
    seen: set[tuple[str, int, int]] = set()
    try:
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        deadline, last_new = time.monotonic() + timeout_s, time.monotonic()
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=200, max_records=5000)
            for tp, records in batch.items():
                for record in records:
                    if (tp.topic, tp.partition, record.offset) in seen:
                        continue
                    seen.add((tp.topic, tp.partition, record.offset))
                    event_id = json.loads(record.value)["event_id"]
                    counts[event_id] += 1
                    kinds[event_id] = "dead_letter" if tp.topic == settings.topic_dead_letters else "analysis"
                    last_new = time.monotonic()
            if expected <= counts.keys() and time.monotonic() - last_new > quiet_s:
                break
    finally:
        await consumer.stop()
    return counts, kinds


async def leader_of(settings: Settings, topic: str, partition: int = 0) -> int:
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        described = await admin.describe_topics([topic])
    finally:
        await admin.close()
    return next(p["leader"] for p in described[0]["partitions"] if p["partition"] == partition)


async def run_scenario(
    cluster: KafkaCluster, scenario: str, guarantee: str, args: argparse.Namespace, console: Console
) -> Outcome:
    settings = scenario_settings(cluster.bootstrap_servers, guarantee, args.real_model)
    await ensure_topics(settings)
    workers = Workers(settings, args.real_model, args.logs)
    n, rate = (args.real_documents, args.real_rate) if args.real_model else (args.documents, args.rate)
    faults: list[str] = []
    down: list[Any] = []
    kills_at = [(k + 1) / (args.worker_kills + 1) * 0.9 for k in range(args.worker_kills)]
    second: list[subprocess.Popen[bytes]] = []
    steps: list[asyncio.Task[None]] = []  # slow fault steps run beside the publisher
    started = time.perf_counter()

    def beside(call: Callable[..., None], *arguments: Any) -> None:
        steps.append(asyncio.create_task(asyncio.to_thread(call, *arguments)))

    async def at_fraction(f: float) -> None:
        nonlocal kills_at
        if scenario in ("input-leader-kill", "output-leader-kill", "broker-restart"):
            if f >= 1 / 3 and not faults:
                topic = (
                    settings.topic_complaints if scenario == "input-leader-kill" else settings.topic_analysis
                )
                node = cluster.nodes[await leader_of(settings, topic) - 1]
                if scenario == "broker-restart":
                    beside(node.stop)
                    faults.append(f"stopped broker {node.node_id} at {f:.0%}")
                else:
                    node.kill()
                    faults.append(f"kill -9 broker {node.node_id} (leader of {topic}[0]) at {f:.0%}")
                down.append(node)
            elif f >= 2 / 3 and down:
                node = down.pop()
                await asyncio.gather(*steps)  # its stop has finished
                beside(cluster.start_node, node)
                faults.append(f"started broker {node.node_id} again at {f:.0%}")
        elif scenario == "worker-kill" and kills_at and f >= kills_at[0]:
            kills_at = kills_at[1:]
            workers.kill(workers.processes[-1])
            workers.start()
            faults.append(f"kill -9 worker at {f:.0%}")
        elif scenario == "rebalance":
            if f >= 1 / 3 and not second:
                second.append(workers.start())
                faults.append(f"second worker joined at {f:.0%}")
            elif f >= 2 / 3 and len(faults) == 1:
                beside(workers.stop, second[0])
                faults.append(f"second worker left at {f:.0%}")

    try:
        workers.start()
        warm = await publish(settings, 1, 100.0, _nothing)  # answered: the worker is up
        await collect(settings, set(warm), 900 if args.real_model else 120, 0.0)
        console.print(f"  {scenario} / {guarantee}: publishing {n} documents at {rate:g}/s ...")
        sent = await publish(settings, n, rate, at_fraction)
        await asyncio.gather(*steps)
        for node in down:  # a fault still open at the end of the stream
            await asyncio.to_thread(cluster.start_node, node)
        counts, kinds = await collect(settings, set(sent), args.collect_timeout_s, quiet_s=5.0)
    finally:
        workers.stop_all()
    answered = set(sent) & counts.keys()
    lost = sorted((sent[e] for e in set(sent) - counts.keys()), key=lambda s: s.index)[:20]
    missing = await diagnose(settings, lost) if lost else []
    return Outcome(
        scenario, guarantee, "real model" if args.real_model else "instant", len(sent), len(answered),
        sum(1 for e in answered if kinds.get(e) == "analysis"), sum(1 for e in answered if kinds.get(e) == "dead_letter"),
        len(set(sent) - counts.keys()), sum(counts[e] - 1 for e in answered), "; ".join(faults),
        round(time.perf_counter() - started, 1), missing,
    )  # fmt: skip


async def diagnose(settings: Settings, lost: list[Sent]) -> list[str]:
    """Where each lost document went missing: what its input record holds, the group's committed
    offset of its partition (past the record: the worker let it go without an answer a reader can
    see), and every answer to it found reading uncommitted (written, then aborted or never
    committed) or committed under another event id (answered from other coordinates)."""
    by_doc = {f"d{s.index}": s for s in lost}
    answers: dict[str, list[str]] = {doc: [] for doc in by_doc}
    found = await partitions_of(settings, [settings.topic_analysis, settings.topic_dead_letters])
    reader = AIOKafkaConsumer(**client_options(settings), isolation_level="read_uncommitted")
    await reader.start()
    try:
        outputs = [TopicPartition(t, p) for t, ps in found.items() for p in ps]
        reader.assign(outputs)
        await reader.seek_to_beginning(*outputs)
        ends = await reader.end_offsets(outputs)
        while [tp for tp, end in ends.items() if await reader.position(tp) < end]:
            for tp, records in (await reader.getmany(timeout_ms=1000)).items():
                for record in records:
                    answer = json.loads(record.value)
                    if (doc := answer.get("document_id")) in answers:
                        src = answer.get("source", {})
                        answers[doc].append(
                            f"{tp.topic}[{tp.partition}]@{record.offset} answers "
                            f"{src.get('topic')}[{src.get('partition')}]@{src.get('offset')}"
                        )
        inputs = {TopicPartition(s.topic, s.partition) for s in lost}
        reader.assign(list(inputs))
        held: dict[Sent, str] = {}
        for s in lost:
            tp = TopicPartition(s.topic, s.partition)
            reader.seek(tp, s.offset)
            batch = await reader.getmany(tp, timeout_ms=5000, max_records=1)
            records = batch.get(tp, [])
            held[s] = json.loads(records[0].value).get("document_id") if records else "nothing"
    finally:
        await reader.stop()
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(settings.consumer_group)
    finally:
        await admin.close()
    lines = []
    for doc, s in by_doc.items():
        tp = TopicPartition(s.topic, s.partition)
        group = committed.get(tp)
        lines.append(
            f"{doc} sent to {s.topic}[{s.partition}]@{s.offset} (which holds {held[s]}); group committed "
            f"{group.offset if group else 'nothing'}; answers read uncommitted: {answers[doc] or 'none'}"
        )
    return lines


async def _nothing(_: float) -> None:
    return None


async def main_async(args: argparse.Namespace, console: Console) -> list[Outcome]:
    outcomes = []
    with kafka_cluster(3) as cluster:
        console.print(f"{cluster.kind}: 3 nodes on {cluster.bootstrap_servers}", highlight=False)
        for scenario in args.scenarios:
            for guarantee in args.guarantees:
                outcome = await run_scenario(cluster, scenario, guarantee, args, console)
                console.print(f"    {outcome}", highlight=False)
                outcomes.append(outcome)
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--guarantees", nargs="+", choices=["at_least_once", "exactly_once"],
                        default=["at_least_once", "exactly_once"])  # fmt: skip
    parser.add_argument("--documents", type=int, default=5_000, help="per scenario, instant analyser")
    parser.add_argument("--rate", type=float, default=250.0, help="documents/s published, instant analyser")
    parser.add_argument("--worker-kills", type=int, default=3)
    parser.add_argument("--real-model", action="store_true", help="the default model instead of the stand-in")
    parser.add_argument("--real-documents", type=int, default=24)
    parser.add_argument("--real-rate", type=float, default=0.2)
    parser.add_argument("--collect-timeout-s", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/kafka-faults.json"))
    parser.add_argument(
        "--logs", type=Path, default=Path("test-artifacts/kafka-faults"), help="workers' logs"
    )
    args = parser.parse_args()
    console = Console(width=160)
    outcomes = asyncio.run(main_async(args, console))
    table = Table("scenario", "guarantee", "analyser", "sent", "answered", "analysis", "dead letters", "lost",
                  "duplicates", "fault", "s", title=f"3-node Apache Kafka, {os.cpu_count()} CPUs")  # fmt: skip
    for o in outcomes:
        table.add_row(o.scenario, o.guarantee, o.analyser, str(o.sent), str(o.answered), str(o.analysis_events),
                      str(o.dead_letters), str(o.lost), str(o.duplicates), o.fault, f"{o.seconds:.0f}")  # fmt: skip
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
               "config": {k: str(v) for k, v in vars(args).items()}, "outcomes": [asdict(o) for o in outcomes]}  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=2, ensure_ascii=False))
    console.print(f"wrote {args.out}")
    missing = {o.scenario + "/" + o.guarantee: o.missing for o in outcomes if o.missing}
    if missing:
        console.print(f"unanswered: {missing}", highlight=False)
    if any(o.lost for o in outcomes) or any(o.duplicates for o in outcomes if o.guarantee == "exactly_once"):
        sys.exit(1)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
