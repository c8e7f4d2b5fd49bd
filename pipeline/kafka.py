"""Kafka clients built from settings: security options, topic creation, broker readiness.

Every client in the service and the CLI is made here, so SASL/TLS settings apply everywhere and
secrets are unwrapped in one place only.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, KafkaError, TopicAlreadyExistsError
from aiokafka.helpers import create_ssl_context
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from pipeline.settings import Settings

log = logging.getLogger(__name__)


def client_options(settings: Settings) -> dict[str, Any]:
    options: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap_servers,
        "client_id": settings.kafka_client_id,
        "security_protocol": settings.kafka_security_protocol,
    }
    if settings.kafka_security_protocol in ("SSL", "SASL_SSL"):
        context: ssl.SSLContext = create_ssl_context(
            cafile=str(settings.kafka_ssl_cafile) if settings.kafka_ssl_cafile else None
        )
        options["ssl_context"] = context
    if settings.kafka_security_protocol.startswith("SASL"):
        options["sasl_mechanism"] = settings.kafka_sasl_mechanism or "PLAIN"
        options["sasl_plain_username"] = settings.kafka_sasl_username
        password = settings.kafka_sasl_password
        options["sasl_plain_password"] = password.get_secret_value() if password else None
    return options


def make_producer(settings: Settings, **overrides: Any) -> AIOKafkaProducer:
    """A plain producer (the pages' and the CLI's documents); `overrides` change one client
    option (a timeout, the linger)."""
    # acks=all: a record counts as delivered only once every in-sync replica has it. Not
    # idempotent: a document's answer id is derived from its send's acknowledgement, which an
    # idempotent producer's duplicate-batch reply reports with another timestamp type
    # (`client.answer_id`); the answers' producer is idempotent (`make_answer_producer`).
    options = client_options(settings) | {"acks": "all", "enable_idempotence": False, "linger_ms": 5}
    return AIOKafkaProducer(**(options | overrides))


def make_answer_producer(settings: Settings) -> AIOKafkaProducer:
    """The producer of analysis events and dead letters: idempotent (KAFKA_ENABLE_IDEMPOTENCE),
    so a send retried after a lost acknowledgement is written once. PROCESSING_GUARANTEE=
    exactly_once uses transactional producers (pipeline/transactions.py) instead."""
    return make_producer(settings, enable_idempotence=settings.kafka_enable_idempotence)


def make_consumer(settings: Settings, *topics: str, grouped: bool = True) -> AIOKafkaConsumer:
    """The worker's consumer (in CONSUMER_GROUP), or with `grouped=False` a reader of assigned
    partitions that joins no group and commits nothing."""
    return AIOKafkaConsumer(
        *topics,
        **client_options(settings),
        group_id=settings.consumer_group if grouped else None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=settings.session_timeout_ms,
        heartbeat_interval_ms=max(100, settings.session_timeout_ms // 3),
        max_poll_records=settings.max_poll_records,
        fetch_max_wait_ms=settings.fetch_max_wait_ms,
        # Records of aborted transactions (ours under exactly_once, or a transactional
        # producer's upstream) are never read; plain records are read as soon as written.
        isolation_level="read_committed",
    )


async def wait_for_broker(settings: Settings, timeout_s: float = 60.0) -> None:
    """Returns once the cluster answers a metadata request; retries while it is still starting."""
    async for attempt in AsyncRetrying(
        retry=retry_if_exception_type(KafkaConnectionError),
        wait=wait_exponential(multiplier=0.2, max=3),
        stop=stop_after_delay(timeout_s),
        reraise=True,
    ):
        with attempt:
            async with admin_client(settings) as admin:
                await admin.list_topics()


async def start_admin(settings: Settings) -> AIOKafkaAdminClient:
    """A started admin client, closed again when starting fails or is cancelled: a client left
    half-started holds connections that nothing closes."""
    admin = AIOKafkaAdminClient(**client_options(settings))
    try:
        await admin.start()
    except BaseException:
        await admin.close()
        raise
    return admin


@asynccontextmanager
async def admin_client(settings: Settings) -> AsyncIterator[AIOKafkaAdminClient]:
    """A started admin client for the block, closed after it."""
    admin = await start_admin(settings)
    try:
        yield admin
    finally:
        await admin.close()


async def ensure_topics(settings: Settings, topics: list[str] | None = None) -> list[str]:
    """Creates the missing topics with the configured partitions; returns the ones it created."""
    wanted = topics if topics is not None else settings.all_topics
    async with admin_client(settings) as admin:
        existing = set(await admin.list_topics())
        missing = [t for t in wanted if t not in existing]
        if not missing:
            return []
        new = [NewTopic(t, settings.topic_partitions, settings.topic_replication_factor) for t in missing]
        response = await admin.create_topics(new)
        created = []
        for name, code, message in _topic_errors(response):
            if code == 0:
                created.append(name)
            elif code != TopicAlreadyExistsError.errno:
                raise KafkaError(f"could not create topic {name}: {message} (error {code})")
        log.info("created topics %s", created)
        await _await_leaders(admin, missing)
        return created


async def partitions_of(settings: Settings, topics: list[str]) -> dict[str, list[int]]:
    """The partition numbers of each of `topics`; LookupError names a topic that does not exist."""
    async with admin_client(settings) as admin:
        described = await admin.describe_topics(topics)
    found = partition_map(described)
    for topic in topics:
        if not found.get(topic):
            raise LookupError(f"topic {topic} has no partitions (does it exist?)")
    return found


def partition_map(described: list[Any]) -> dict[str, list[int]]:
    """An admin `describe_topics` answer as topic -> its partition numbers (topics it found)."""
    return {
        t["topic"]: sorted(p["partition"] for p in t["partitions"]) for t in described if t["error_code"] == 0
    }


async def _await_leaders(admin: AIOKafkaAdminClient, topics: list[str], timeout_s: float = 30.0) -> None:
    """Waits until every partition of `topics` has a leader. Kafka answers CreateTopics once the
    controller has accepted them; the brokers learn of them a moment later, and a producer or a
    reader arriving in that moment is told the topic does not exist."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        described = await admin.describe_topics(topics)
        pending = [
            t["topic"]
            for t in described
            if t["error_code"] != 0 or not t["partitions"] or any(p["leader"] < 0 for p in t["partitions"])
        ]
        if not pending:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise KafkaError(f"topics {pending} have no leader after {timeout_s:.0f} s")
        await asyncio.sleep(0.1)


def _topic_errors(response: Any) -> list[tuple[str, int, str | None]]:
    return [(e[0], e[1], e[2] if len(e) > 2 else None) for e in response.topic_errors]
