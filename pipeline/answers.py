"""What the web front end knows of the answer topics: every analysis event and dead letter as it
lands, for the page waiting on its own document and for the live triage board.

One consumer without a group reads both answer topics (every worker's answers, whichever worker
produced them) from the beginning of the last hour where the broker can seek by time, else from
the beginning. Each answer gets a sequence number, the server-sent event id, so a reconnecting
client asks for what it missed (`Last-Event-ID`). It starts reading when a page first needs it.
The most recent answers stay in memory (bounded) for replay and for a waiter that asks after its
answer already arrived. A waiter names its document as well as its event id, and gets only an
answer to that document: an id seen before under another document (forged, or from before a
topic was re-created) is never handed to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from pydantic import ValidationError

from pipeline.client import Answer, assign_answer_topics, parse_answer
from pipeline.kafka import make_consumer
from pipeline.settings import Settings
from schemas import AnalysisProgress, DeadLetter

log = logging.getLogger(__name__)

MAX_PER_ID = 4


@dataclass(frozen=True)
class Delivered:
    seq: int  # the server-sent event id: rising, per process
    event_id: str
    document_id: str | None
    kind: str  # "analysis" | "dead_letter" | "partial" (an analysis as it is written)
    json: str  # the record's value as published


class AnswerHub:
    def __init__(self, settings: Settings, keep: int = 2_000, history_s: float = 3_600.0) -> None:
        self.settings = settings
        self.history_s = history_s
        # Oldest first, at most `keep`; a few answers per id, each for another document.
        self._by_event: OrderedDict[str, list[Delivered]] = OrderedDict()
        self._keep = keep
        self._seq = 0
        # Per event id, the latest analysis-as-written (`AnalysisProgress`) while it has no answer;
        # numbered apart from the answers (the board's stream counts those alone).
        self._progress: OrderedDict[str, Delivered] = OrderedDict()
        self._progress_seq = 0
        self._changed = asyncio.Condition()
        self.connected = False  # the consumer has its partitions and is reading
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def ensure_running(self) -> None:
        """Starts reading on first demand: a worker nobody browses spends nothing on its pages."""
        if self._task is None:
            self._task = asyncio.create_task(self.run(self._stop))

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    async def close(self) -> None:
        """Stops reading; every `follow` and `wait_for` returns (open event streams end, so the
        HTTP server can stop)."""
        self._stop.set()
        async with self._changed:
            self._changed.notify_all()
        if self._task is not None:
            await self._task

    def find(self, event_id: str, document_id: str | None = None) -> Delivered | None:
        """The first answer under `event_id` (to `document_id`, when given)."""
        for item in self._by_event.get(event_id, ()):
            if document_id is None or item.document_id == document_id:
                return item
        return None

    async def wait_for(
        self, event_id: str, timeout_s: float, document_id: str | None = None
    ) -> Delivered | None:
        """The answer to `event_id` (and `document_id`, when given) once it lands (None after
        `timeout_s`)."""
        self.ensure_running()
        deadline = time.monotonic() + timeout_s
        async with self._changed:
            while (found := self.find(event_id, document_id)) is None:
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), left)
            return found

    async def watch(self, event_id: str, wait_s: float) -> AsyncIterator[Delivered | None]:
        """The analysis of `event_id` as it is written (`partial` items, newest only), then its
        answer, which ends it; None after `wait_s` without news (time for a keep-alive). Ends
        without the answer when the hub is closed."""
        self.ensure_running()
        shown = 0
        while not self.closed:
            async with self._changed:
                found = self.find(event_id)
                partial = self._progress.get(event_id)
                news = partial if partial is not None and partial.seq > shown else None
                if found is None and news is None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), wait_s)
                        continue
            if found is not None:
                yield found
                return
            if news is not None:
                shown = news.seq
            yield news

    async def follow(
        self, after: int | None, replay: int, heartbeat_s: float = 15.0
    ) -> AsyncIterator[Delivered | None]:
        """Answers with a sequence number above `after` (or the last `replay` ones), then each new
        one as it lands; None after `heartbeat_s` without any (time for a keep-alive). Ends when
        the hub is closed."""
        self.ensure_running()
        if after is None:  # sequence numbers are contiguous: the last `replay` are above this
            after = max(0, self._seq - replay)
        elif after > self._seq:  # a client of an earlier process: its ids mean nothing here
            after = 0
        while not self.closed:
            pending = sorted(
                (d for items in self._by_event.values() for d in items if d.seq > after), key=lambda d: d.seq
            )
            for item in pending:
                yield item
                after = item.seq
            if pending:
                continue
            async with self._changed:
                if self._seq <= after and not self.closed:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), heartbeat_s)
            if self._seq <= after and not self.closed:
                yield None

    async def _add(self, answer: Answer, value: bytes) -> None:
        known = self._by_event.get(answer.event_id, [])
        if any(item.document_id == answer.document_id for item in known) or len(known) >= MAX_PER_ID:
            return  # a redelivery answers again under the same id (or someone floods one id)
        kind = "dead_letter" if isinstance(answer, DeadLetter) else "analysis"
        async with self._changed:
            self._seq += 1
            item = Delivered(self._seq, answer.event_id, answer.document_id, kind, value.decode("utf-8"))
            self._by_event.setdefault(answer.event_id, []).append(item)
            while len(self._by_event) > self._keep:
                self._by_event.popitem(last=False)
            self._changed.notify_all()

    async def _add_progress(self, value: bytes) -> None:
        try:
            progress = AnalysisProgress.model_validate_json(value)
        except ValidationError:
            return
        if progress.event_id in self._by_event:
            return  # answered already: a late preview would only go back in time
        async with self._changed:
            self._progress_seq += 1
            item = Delivered(
                self._progress_seq, progress.event_id, progress.document_id, "partial", value.decode()
            )
            self._progress[progress.event_id] = item
            self._progress.move_to_end(progress.event_id)
            while len(self._progress) > self._keep:
                self._progress.popitem(last=False)
            self._changed.notify_all()

    async def run(self, stop: asyncio.Event) -> None:
        """Reads until `stop`; reconnects by itself when the broker goes away."""
        while not stop.is_set():
            consumer = make_consumer(self.settings, grouped=False)
            try:
                await consumer.start()
                await self._assign(consumer)
                self.connected = True
                while not stop.is_set():
                    batch = await consumer.getmany(timeout_ms=200, max_records=500)
                    for tp, records in batch.items():
                        for record in records:
                            if tp.topic == self.settings.topic_progress:
                                await self._add_progress(record.value or b"")
                                continue
                            answer = parse_answer(tp.topic, record.value or b"", self.settings)
                            if answer is not None:
                                await self._add(answer, record.value or b"")
            except (KafkaError, OSError, LookupError) as exc:
                self.connected = False
                log.warning("answer topics unreadable (%s); retrying", type(exc).__name__)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 2.0)
            finally:
                self.connected = False
                with contextlib.suppress(Exception):
                    await consumer.stop()

    async def _assign(self, consumer: AIOKafkaConsumer) -> None:
        parts = await assign_answer_topics(consumer, self.settings, progress=True)
        since_ms = int((time.time() - self.history_s) * 1000)
        with contextlib.suppress(KafkaError, ValueError, TypeError):  # brokers that cannot seek by time
            for tp, found in (await consumer.offsets_for_times({tp: since_ms for tp in parts})).items():
                if found is not None:
                    consumer.seek(tp, found.offset)
