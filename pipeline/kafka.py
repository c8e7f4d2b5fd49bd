"""Kafka clients built from settings: security options, topic creation, broker readiness.

Every client in the service and the CLI is made here, so SASL/TLS settings apply everywhere and
secrets are unwrapped in one place only.
"""

from __future__ import annotations

import logging
import ssl
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


def make_producer(settings: Settings) -> AIOKafkaProducer:
    # acks=all: an answer counts as delivered only once every in-sync replica has it. Not
    # idempotent: the embedded broker rejects idempotent producers, and duplicates are already
    # harmless (same event_id).
    return AIOKafkaProducer(**client_options(settings), acks="all", enable_idempotence=False, linger_ms=5)


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
            admin = AIOKafkaAdminClient(**client_options(settings))
            try:
                await admin.start()
                await admin.list_topics()
            finally:
                await admin.close()


async def ensure_topics(settings: Settings, topics: list[str] | None = None) -> list[str]:
    """Creates the missing topics with the configured partitions; returns the ones it created."""
    wanted = topics if topics is not None else settings.all_topics
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
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
        return created
    finally:
        await admin.close()


def _topic_errors(response: Any) -> list[tuple[str, int, str | None]]:
    return [(e[0], e[1], e[2] if len(e) > 2 else None) for e in response.topic_errors]
