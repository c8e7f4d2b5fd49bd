"""The load test's traffic: an open-loop arrival schedule, a sender, and a collector that proves
what became of every document sent.

- `schedule`: Poisson arrivals per department (the article's five), merged; each arrival carries a
  document drawn from the corpus. Open loop: a document is sent at its time whether or not earlier
  ones were answered, so the machine, not the generator, sets the pace.
- `Sender`: publishes a document at its scheduled time without waiting for earlier acks and records
  the coordinates the broker acknowledged (with its bytes and timestamp, they name the answer: `answer_id`) and its CreateTime.
- `Collector`: reads the analysis and dead-letter topics from their beginning and keeps, per event
  id, the first answer and its CreateTime. Latency = answer CreateTime - document CreateTime (both
  producer clocks on this machine); a document with no answer within the deadline has timed out.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka import AIOKafkaProducer

from pipeline.client import answer_id, assign_answer_topics, parse_answer
from pipeline.codec import encode_document
from pipeline.kafka import make_consumer
from pipeline.settings import Settings
from schemas import AnalysisEvent, DocumentEvent, DocumentKind, Language

DEPARTMENTS = ("marketing", "product", "customer_service", "strategy", "legal")
DATA = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class CorpusDoc:
    document_id: str
    kind: DocumentKind
    language: Language
    text: str


def load_corpus(min_chars: int = 300, max_chars: int = 2_000) -> list[CorpusDoc]:
    """Every bundled corpus document of `min_chars`..`max_chars` characters (the article's range)."""
    docs = []
    for name in ("corpus.jsonl", "kv-corpus.jsonl"):
        for line in (DATA / name).read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            if min_chars <= len(row["text"]) <= max_chars:
                kind, language = DocumentKind(row["kind"]), Language(row["language"])
                docs.append(CorpusDoc(row["document_id"], kind, language, row["text"]))
    return docs


@dataclass(frozen=True)
class Arrival:
    at_s: float  # offset from the start of its level
    department: str
    doc: CorpusDoc


def schedule(
    rate_per_min: float,
    duration_s: float,
    corpus: list[CorpusDoc],
    seed: int,
    min_count: int = 0,
    departments: tuple[str, ...] = DEPARTMENTS,
    exact: bool = False,
) -> list[Arrival]:
    """Poisson arrivals at `rate_per_min` in all, split evenly over the departments, for
    `duration_s` - or longer, at the same rate, until there are at least `min_count`.

    `exact`: the same process conditioned on its count, the expected one (rate x duration,
    rounded up, the window stretched to match): arrival times uniform over the window, each from
    a department drawn evenly. A short level then offers exactly its nominal load; unconditioned,
    45 s at 24/min sends anywhere from 11 to 25."""
    rng = random.Random(seed)
    if exact:
        count = max(min_count, math.ceil(rate_per_min * duration_s / 60 - 1e-9))
        window = count * 60 / rate_per_min
        times = sorted(rng.uniform(0, window) for _ in range(count))
        return [Arrival(t, rng.choice(departments), rng.choice(corpus)) for t in times]
    per_department = rate_per_min / 60 / len(departments)  # arrivals per second
    clocks = {d: rng.expovariate(per_department) for d in departments}
    arrivals: list[Arrival] = []
    while True:
        department = min(clocks, key=clocks.__getitem__)  # the next arrival of the merged process
        t = clocks[department]
        if t >= duration_s and len(arrivals) >= min_count:
            return arrivals
        arrivals.append(Arrival(t, department, rng.choice(corpus)))
        clocks[department] = t + rng.expovariate(per_department)


def arrival_window(arrivals: list[Arrival], rate_per_min: float, duration_s: float, exact: bool) -> float:
    """The seconds `schedule` drew these arrivals over: with exact counts, the window stretched to
    keep the rate; otherwise the duration, or longer if min_count ran past it."""
    if exact:
        return len(arrivals) * 60 / rate_per_min
    return max(duration_s, arrivals[-1].at_s)


@dataclass
class Sent:
    """One document on the bus, and what became of it."""

    event_id: str
    document_id: str
    config: str
    level: int
    department: str
    kind: str
    language: str
    chars: int
    sent_ms: int  # the document record's CreateTime
    answer: str | None = None  # "analysis" | "dead_letter"
    answered_ms: int | None = None  # the answer record's CreateTime
    reason: str | None = None  # a dead letter's error type
    ttft_ms: float | None = None
    output_tokens: int | None = None

    @property
    def latency_s(self) -> float | None:
        return None if self.answered_ms is None else (self.answered_ms - self.sent_ms) / 1000


class Sender:
    def __init__(self, settings: Settings, producer: AIOKafkaProducer, config: str) -> None:
        self.settings, self.producer, self.config = settings, producer, config
        self._count = 0

    async def send(self, doc: CorpusDoc, department: str, level: int) -> asyncio.Future[Sent]:
        """Hands the document to the producer now; the future resolves once the broker acknowledged it."""
        self._count += 1
        document_id = f"{self.config}-{level}-{self._count:05d}-{doc.document_id}"
        event = DocumentEvent(
            document_id=document_id, kind=doc.kind, text=doc.text, language=doc.language,
            source_system="bench.load_test", metadata={"department": department},
        )  # fmt: skip
        value, headers = encode_document(event)
        now_ms = int(time.time() * 1000)
        ack = await self.producer.send(
            self.settings.topic_for(doc.kind),
            value,
            key=document_id.encode(),
            headers=headers,
            timestamp_ms=now_ms,
        )

        async def acknowledged() -> Sent:
            meta = await ack
            return Sent(
                answer_id(meta, value, now_ms), document_id, self.config, level,
                department, doc.kind, doc.language.value, len(doc.text), now_ms,
            )  # fmt: skip

        return asyncio.ensure_future(acknowledged())


@dataclass
class Collector:
    """Every answer on the two answer topics, first one per event id."""

    settings: Settings
    answers: dict[str, tuple[str, int, str | None, float | None, int | None]] = field(default_factory=dict)
    duplicates: int = 0
    unparseable: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        consumer = make_consumer(self.settings, grouped=False)
        await consumer.start()
        try:
            await assign_answer_topics(consumer, self.settings)
            while not stop.is_set():
                for tp, records in (await consumer.getmany(timeout_ms=200, max_records=1000)).items():
                    for record in records:
                        self._add(tp.topic, record.value or b"", record.timestamp)
        finally:
            await consumer.stop()

    def _add(self, topic: str, value: bytes, timestamp_ms: int) -> None:
        answer = parse_answer(topic, value, self.settings)
        if answer is None:
            self.unparseable += 1
            return
        if answer.event_id in self.answers:
            self.duplicates += 1  # at-least-once: a redelivery answers again under the same id
            return
        if isinstance(answer, AnalysisEvent):
            t = answer.timings
            entry = ("analysis", timestamp_ms, None, t.time_to_first_token_ms, t.output_tokens)
        else:
            entry = ("dead_letter", timestamp_ms, answer.error_type.value, None, None)
        self.answers[answer.event_id] = entry

    def resolve(self, sent: Sent) -> bool:
        """Fills in the document's answer if one has arrived; True when it has."""
        found = self.answers.get(sent.event_id)
        if found is None:
            return False
        sent.answer, sent.answered_ms, sent.reason, sent.ttft_ms, sent.output_tokens = found
        return True


async def drain(
    collector: Collector,
    sent: list[Sent],
    deadline_s: float,
    on_answered: Callable[[int], object] | None = None,
) -> None:
    """Waits until every document is answered or has been out longer than the deadline."""
    while True:
        waiting = [s for s in sent if not collector.resolve(s)]
        if on_answered is not None:
            on_answered(len(sent) - len(waiting))
        now_ms = time.time() * 1000
        if all(now_ms - s.sent_ms > deadline_s * 1000 for s in waiting):
            return
        await asyncio.sleep(0.25)
