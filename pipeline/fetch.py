"""Getting records out of Kafka when some cannot be parsed by the client.

aiokafka parses a fetched batch record by record as `getmany` hands them out, and raises when one
cannot be parsed (a header key that is not UTF-8, a batch that fails its CRC). It raises on every
fetch after that, so one such record would freeze its partition for good; and the records of the
same fetch parsed before it are dropped from the client's buffer, never handed out.

`Fetcher.fetch` turns that into something the service can answer: it rewinds every assigned
partition to the next offset the service has not seen (nothing parsed-but-dropped is lost), then
reads one record at a time, partition by partition, until the record that fails is found; that
record comes back as an `Unreadable` at its offset (it gets a dead letter like any bad record)
and reading goes on after it. Knows nothing of documents, answers or commits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import CorruptRecordException
from aiokafka.structs import TopicPartition

log = logging.getLogger(__name__)

# What the client raises for a record it cannot parse; anything else is not about one record.
PARSE_ERRORS: tuple[type[Exception], ...] = (UnicodeDecodeError, CorruptRecordException)


@dataclass(frozen=True)
class Unreadable:
    """A record the client could not parse: where it lies and why (its bytes stay on the topic)."""

    topic: str
    partition: int
    offset: int
    error: str


Fetched = list[tuple[TopicPartition, Any]]  # (partition, ConsumerRecord | Unreadable), in order


class Fetcher:
    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        next_to_read: Callable[[TopicPartition], int | None],
        timeout_ms: int = 200,
    ) -> None:
        self.consumer = consumer
        self.next_to_read = next_to_read  # the service's own position: one past what it registered
        self.timeout_ms = timeout_ms

    async def fetch(self, max_records: int) -> Fetched:
        """Up to `max_records` records (or unreadable ones) from the assigned partitions."""
        try:
            batch = await self.consumer.getmany(timeout_ms=self.timeout_ms, max_records=max_records)
        except PARSE_ERRORS as exc:
            log.warning("a fetched record cannot be parsed (%s); reading one by one", type(exc).__name__)
            return await self._read_carefully(max_records)
        return [(tp, record) for tp, records in batch.items() for record in records]

    async def _read_carefully(self, max_records: int) -> Fetched:
        partitions = sorted(self.consumer.assignment())
        for tp in partitions:
            await self._rewind(tp)
        found: Fetched = []
        for tp in partitions:
            while len(found) < max_records:
                item = await self._read_one(tp)
                if item is None:
                    break
                found.append((tp, item))
        return found

    async def _rewind(self, tp: TopicPartition) -> None:
        position = self.next_to_read(tp)
        if position is None:
            position = await self.consumer.committed(tp)
        if position is None:
            await self.consumer.seek_to_beginning(tp)
        else:
            self.consumer.seek(tp, position)

    async def _read_one(self, tp: TopicPartition) -> Any:
        """The next record of `tp`, an `Unreadable` in its place, or None when there is none now."""
        error: Exception | None = None
        for _ in range(2):  # a second try: a CRC failure may have been the network's
            offset = await self.consumer.position(tp)
            try:
                batch = await self.consumer.getmany(tp, timeout_ms=self.timeout_ms, max_records=1)
            except PARSE_ERRORS as exc:
                error = exc
                self.consumer.seek(tp, offset)
                continue
            records = batch.get(tp, [])
            return records[0] if records else None
        self.consumer.seek(tp, offset + 1)
        log.warning("%s[%d]@%d cannot be parsed: %s", tp.topic, tp.partition, offset, type(error).__name__)
        return Unreadable(tp.topic, tp.partition, offset, f"{type(error).__name__}: {error}")
