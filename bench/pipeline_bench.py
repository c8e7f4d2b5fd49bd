"""The pipeline's own throughput and added latency, with an analyser that answers at once.

One broker of its own (Apache Kafka where Java is here, else the Tansu emulator; the JSON names
it); each variant gets topics and a consumer group of its own and one worker
process (`bench/pipeline_worker.py`: the real Service, decode -> spans -> metrics -> publish ->
offsets -> commits, with no model):
- drain: N documents published as fast as the producer goes at a warm, idle worker (a burst many
  times its rate): documents/s between the first and the last answer, and the worker's RSS idle
  vs at its peak while it drains (MAX_INFLIGHT bounds what it holds);
- paced: documents published at a fixed rate to a running worker: added latency per document =
  the answer's timestamp minus the document's (both producer CreateTime, same machine clock).
Each under `--guarantees`: at_least_once, and exactly_once (answers and offsets committed in one
transaction per partition; answers are read with read_committed, so their latency includes the
wait for the commit that makes them visible).
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition
from rich.console import Console
from rich.table import Table

from bench.common import worker_env
from pipeline.broker import embedded_broker
from pipeline.client import answer_id
from pipeline.kafka import client_options, ensure_topics
from pipeline.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["快递晚到了五天，还多收了安装费，客服一直不回复。", "Revenue grew 9% to $2.8 billion; margin guidance unchanged.",
         "会议决定下周上线新版本，测试由王工负责。", "The replacement part arrived broken again; I want a refund."]  # fmt: skip


@dataclass
class Result:
    variant: str
    guarantee: str
    max_inflight: int
    traces_sampled: float
    documents: int
    docs_per_s: float
    latency_p50_ms: float | None
    latency_p95_ms: float | None
    latency_p99_ms: float | None
    rss_idle_mib: float | None
    rss_peak_mib: float | None
    rss_end_mib: float | None


def variant_settings(servers: str, max_inflight: int, fetch_wait_ms: int, guarantee: str) -> Settings:
    run = uuid.uuid4().hex[:8]
    return load_settings(
        kafka_bootstrap_servers=servers, consumer_group=f"bench-{run}", topic_partitions=3,
        topic_complaints=f"b{run}.complaints", topic_meeting_notes=f"b{run}.notes", topic_filings=f"b{run}.filings",
        topic_analysis=f"b{run}.analysis", topic_dead_letters=f"b{run}.dlq", max_inflight=max_inflight,
        max_poll_records=500, commit_interval_ms=1000, status_port=0, fetch_max_wait_ms=fetch_wait_ms,
        processing_guarantee=guarantee,
    )  # fmt: skip


def worker(settings: Settings, sampled: float) -> subprocess.Popen[bytes]:
    env = worker_env(settings)
    if sampled < 1:  # the SDK's own switches: keep this share of traces (every span of a kept one)
        env |= {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": str(sampled)}
    return subprocess.Popen([sys.executable, "-m", "bench.pipeline_worker"], cwd=ROOT, env=env)


async def publish(
    producer: AIOKafkaProducer, settings: Settings, n: int, rate: float | None
) -> dict[str, int]:
    """Publishes n documents (at `rate` per second, or at once); event id -> CreateTime (ms)."""
    rng, topics, futures, sent = random.Random(n), list(settings.input_topics), [], []
    start = time.perf_counter()
    for i in range(n):
        if rate is not None and i % 20 == 0:  # pace in small groups
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
        value = json.dumps({"document_id": f"d{i}", "text": f"{rng.choice(TEXTS)} #{i}"}).encode()
        now_ms = int(time.time() * 1000)
        sent.append((value, now_ms))
        futures.append(
            await producer.send(
                rng.choice(topics),
                value,
                headers=[("content-type", b"application/json")],
                timestamp_ms=now_ms,
            )
        )
    acks = await asyncio.gather(*futures)
    return {answer_id(m, value, now_ms): now_ms for m, (value, now_ms) in zip(acks, sent, strict=True)}


async def collect(
    settings: Settings, expected: set[str], timeout_s: float, rss: list[float], pid: int
) -> dict[str, int]:
    """Answer event id -> answer CreateTime (ms), sampling the worker's RSS meanwhile."""
    consumer = AIOKafkaConsumer(
        **client_options(settings),
        group_id=None,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
    )
    await consumer.start()
    try:
        partitions = [TopicPartition(settings.topic_analysis, p) for p in range(settings.topic_partitions)]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        answers: dict[str, int] = {}
        deadline, sampled = time.monotonic() + timeout_s, 0.0
        process = psutil.Process(pid)
        while time.monotonic() < deadline and not expected <= answers.keys():
            for records in (await consumer.getmany(timeout_ms=100, max_records=5000)).values():
                for record in records:
                    answers[json.loads(record.value)["event_id"]] = record.timestamp
            if time.monotonic() - sampled > 0.2:
                rss.append(process.memory_info().rss / 2**20)
                sampled = time.monotonic()
        return answers
    finally:
        await consumer.stop()


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def run_variant(
    servers: str,
    name: str,
    n: int,
    max_inflight: int,
    rate: float | None,
    fetch_wait_ms: int,
    sampled: float,
    guarantee: str,
) -> Result:
    settings = variant_settings(servers, max_inflight, fetch_wait_ms, guarantee)
    await ensure_topics(settings)
    producer = AIOKafkaProducer(**client_options(settings), acks="all", linger_ms=5, enable_idempotence=False)
    await producer.start()
    proc, rss = None, []
    try:
        proc = worker(settings, sampled)
        warm = await publish(producer, settings, 1, None)  # answered: the worker is up
        await collect(settings, set(warm), 120, [], proc.pid)
        rss.append(psutil.Process(proc.pid).memory_info().rss / 2**20)  # idle, warm
        sent = await publish(producer, settings, n, rate)  # rate None: as fast as the producer goes
        answers = await collect(settings, set(sent) | set(warm), 600, rss, proc.pid)
    finally:
        await producer.stop()
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    missing = set(sent) - answers.keys()
    if missing:
        raise RuntimeError(f"{name}: {len(missing)} documents unanswered")
    stamps = sorted(answers[e] for e in sent)
    span_s = max((stamps[-1] - stamps[0]) / 1000, 1e-3)
    latencies = [answers[e] - sent[e] for e in sent] if rate is not None else []
    return Result(
        name, guarantee, max_inflight, sampled, n, (n - 1) / span_s, pct(latencies, 50), pct(latencies, 95), pct(latencies, 99),
        rss[0] if rss else None, max(rss) if rss else None, rss[-1] if rss else None,
    )  # fmt: skip


async def main_async(args: argparse.Namespace, console: Console) -> tuple[str, list[Result]]:
    results = []
    with embedded_broker() as broker:
        console.print(f"broker: {broker.kind}", highlight=False)
        plan: list[tuple[str, int, int, float | None, float]] = [
            ("drain", args.burst, 32, None, 1.0), ("drain", args.burst, 256, None, 1.0), ("drain", args.burst, 32, None, 0.01)
        ] if args.drain else []  # fmt: skip
        for inflight in args.paced_inflight:
            for sampled in (1.0, 0.01):
                plan += [("paced", int(rate * args.seconds), inflight, rate, sampled) for rate in args.rates]
        for guarantee in args.guarantees:
            for name, n, inflight, rate, sampled in plan:
                console.print(
                    f"running {name} {guarantee} ({n} documents, MAX_INFLIGHT={inflight}, "
                    f"traces sampled {sampled:.0%}) ..."
                )
                results.append(
                    await run_variant(
                        broker.bootstrap_servers,
                        name,
                        n,
                        inflight,
                        rate,
                        args.fetch_wait_ms,
                        sampled,
                        guarantee,
                    )
                )
        kind = broker.kind
    return kind, results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--burst", type=int, default=20_000, help="documents waiting in the drain variants")
    parser.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=[500.0, 1_000.0, 2_000.0],
        help="paced variants, documents/s",
    )
    parser.add_argument(
        "--fetch-wait-ms", type=int, default=10,
        help="the worker's FETCH_MAX_WAIT_MS (the Tansu emulator holds an empty fetch this long even when records arrive)",
    )  # fmt: skip
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the paced variant")
    parser.add_argument(
        "--paced-inflight", type=int, nargs="+", default=[32, 256],
        help="MAX_INFLIGHT of the paced variants (at 2,000/s x ~15 ms, 32 in flight is the bound itself)",
    )  # fmt: skip
    parser.add_argument(
        "--drain", action=argparse.BooleanOptionalAction, default=True, help="run the drain variants"
    )
    parser.add_argument(
        "--guarantees", nargs="+", choices=["at_least_once", "exactly_once"],
        default=["at_least_once", "exactly_once"], help="PROCESSING_GUARANTEE of the worker, each in turn",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench/results/pipeline.json"))
    args = parser.parse_args()
    console = Console(width=140)
    broker, results = asyncio.run(main_async(args, console))
    table = Table("variant", "guarantee", "MAX_INFLIGHT", "traces", "documents", "docs/s", "p50 ms", "p95 ms", "p99 ms",
                  "RSS idle MiB", "RSS peak MiB", "RSS end MiB", title=f"pipeline, instant analyser, {os.cpu_count()} CPUs, {broker}")  # fmt: skip

    def cell(value: float | None, digits: int = 0) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    for r in results:
        table.add_row(r.variant, r.guarantee, str(r.max_inflight), f"{r.traces_sampled:.0%}", str(r.documents), cell(r.docs_per_s), cell(r.latency_p50_ms),
                      cell(r.latency_p95_ms), cell(r.latency_p99_ms), cell(r.rss_idle_mib), cell(r.rss_peak_mib),
                      cell(r.rss_end_mib))  # fmt: skip
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {"machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()}, "broker": broker,
                               "config": {k: str(v) for k, v in vars(args).items()}, "results": [asdict(r) for r in results]}  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=2))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
