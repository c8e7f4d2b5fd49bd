"""A periodic look at the cluster from the worker's side: can it be reached, do the topics still
exist with the partitions they had, and how far behind the group is on every input partition.

Why: a memory-only broker that restarts, or a topic deleted by hand, comes back without the
topics; the first answer published would then create its topic with the broker's defaults. The
watch re-creates missing topics with the configured partitions (`ensure_topics`) as soon as it
sees them gone, and reports a partition count that differs from the one first seen (a topic
re-created behind our back) in `/api/status`; the service reads a re-created input topic
from its start (its offsets began again at 0). Lag covers every partition of the input topics,
also those assigned to no one or to other workers (end offset minus the group's commit), so an
unread partition does not show lag 0. Reachability changes are logged once each, not per retry.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

from pipeline.kafka import ensure_topics, partition_map, start_admin
from pipeline.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class ClusterView:
    reachable: bool | None = None  # None until the first look
    partitions: dict[str, int] = field(default_factory=dict)  # topic -> partitions, as last seen
    expected: dict[str, int] = field(default_factory=dict)  # topic -> partitions, as first seen
    lag: dict[TopicPartition, int] = field(default_factory=dict)  # every input partition
    recreated: set[str] = field(default_factory=set)  # topics found missing and created again (each once)

    @property
    def problems(self) -> list[str]:
        return [
            f"{topic} has {self.partitions.get(topic, 0)} partitions; it had {count}"
            for topic, count in sorted(self.expected.items())
            if self.partitions.get(topic, 0) != count
        ]


class ClusterWatch:
    def __init__(
        self,
        settings: Settings,
        consumer: AIOKafkaConsumer,
        on_recreated: Callable[[list[str]], Awaitable[None]] | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.settings = settings
        self.consumer = consumer
        self.on_recreated = on_recreated
        self.timeout_s = timeout_s
        self.view = ClusterView()
        self._admin: AIOKafkaAdminClient | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Looks every `CLUSTER_CHECK_INTERVAL_S` until `stop`."""
        try:
            while not stop.is_set():
                await self.check()
                try:
                    await asyncio.wait_for(stop.wait(), self.settings.cluster_check_interval_s)
                except TimeoutError:
                    continue
        finally:
            await self._drop_admin()

    async def check(self) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._look()
        except (KafkaError, OSError, TimeoutError) as exc:
            await self._drop_admin()
            self._reachable(False, f"{type(exc).__name__}: {exc}")
            return
        self._reachable(True, "")

    async def _look(self) -> None:
        view = self.view
        seen = await self._partitions()
        missing = [topic for topic, found in seen.items() if not found]
        if missing:
            log.warning("topics %s are gone (broker restarted, or deleted); creating them again", missing)
            await ensure_topics(self.settings, missing)
            view.recreated.update(missing)
            if self.on_recreated is not None:
                await self.on_recreated(missing)
            seen = await self._partitions()
        for topic, found in seen.items():
            count = len(found)
            if count and topic not in view.expected:
                view.expected[topic] = count
            elif count != view.partitions.get(topic) and count != view.expected.get(topic):
                log.error("%s now has %d partitions; it had %d", topic, count, view.expected.get(topic, 0))
        view.partitions = {topic: len(found) for topic, found in seen.items()}
        view.lag = await self._lag(seen)

    async def _partitions(self) -> dict[str, list[int]]:
        """Each of our topics' partition ids (empty: the topic does not exist)."""
        if self._admin is None:
            self._admin = await start_admin(self.settings)
        # All topics: a request that names none creates none (naming one may auto-create it).
        found = partition_map(await self._admin.describe_topics())
        return {topic: found.get(topic, []) for topic in self.settings.all_topics}

    async def _lag(self, seen: dict[str, list[int]]) -> dict[TopicPartition, int]:
        partitions = [TopicPartition(t, p) for t in self.settings.input_topics for p in seen.get(t, ())]
        if not partitions:
            return {}
        ends = await self.consumer.end_offsets(partitions)
        lag = {}
        for tp in partitions:
            committed = await self.consumer.committed(tp)
            lag[tp] = max(0, ends[tp] - (committed or 0))
        return lag

    async def _drop_admin(self) -> None:
        admin, self._admin = self._admin, None
        if admin is not None:
            try:
                await asyncio.wait_for(admin.close(), self.timeout_s)
            except (KafkaError, OSError, TimeoutError):
                log.debug("closing the watch's admin client failed", exc_info=True)

    def _reachable(self, reachable: bool, why: str) -> None:
        if reachable != self.view.reachable:
            if reachable:
                log.info("Kafka cluster reachable%s", " again" if self.view.reachable is False else "")
            else:
                log.warning("Kafka cluster unreachable (%s); retrying quietly", why)
        self.view.reachable = reachable
