"""The Kafka clients the pipeline builds: an admin client or a producer that fails to start is
closed, not left holding the connections it opened (aiokafka reports those as unclosed when
collected)."""

from __future__ import annotations

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError

import pipeline.kafka
from pipeline.client import publish_documents, publish_raw
from pipeline.kafka import admin_client, start_admin
from pipeline.settings import Settings


class FailingAdmin(AIOKafkaAdminClient):  # type: ignore[misc]
    """Fails its start as a broker that drops the connection after the bootstrap would."""

    closed: list[FailingAdmin] = []  # noqa: RUF012 (the test's record, reset by it)

    async def start(self) -> None:
        raise KafkaConnectionError("dropped after the bootstrap")

    async def close(self) -> None:
        FailingAdmin.closed.append(self)
        await super().close()


async def test_an_admin_client_that_fails_to_start_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(kafka_bootstrap_servers="127.0.0.1:9")  # never reached: start fails first
    monkeypatch.setattr(pipeline.kafka, "AIOKafkaAdminClient", FailingAdmin)
    FailingAdmin.closed = []
    with pytest.raises(KafkaConnectionError):
        await start_admin(settings)
    assert len(FailingAdmin.closed) == 1
    with pytest.raises(KafkaConnectionError):
        async with admin_client(settings):
            pytest.fail("the block runs only with a started client")
    assert len(FailingAdmin.closed) == 2  # closed once, by start_admin


class FailingProducer(AIOKafkaProducer):  # type: ignore[misc]
    """Bootstraps, then fails its start as a broker that refuses the producer would."""

    stopped: list[FailingProducer] = []  # noqa: RUF012 (the test's record, reset by it)

    async def start(self) -> None:
        raise KafkaConnectionError("dropped after the bootstrap")

    async def stop(self) -> None:
        FailingProducer.stopped.append(self)
        await super().stop()


async def test_a_producer_that_fails_to_start_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(kafka_bootstrap_servers="127.0.0.1:9")  # never reached: start fails first
    monkeypatch.setattr(pipeline.kafka, "AIOKafkaProducer", FailingProducer)
    FailingProducer.stopped = []
    with pytest.raises(KafkaConnectionError):
        await publish_raw(settings, "documents", b"{}")
    with pytest.raises(KafkaConnectionError):
        await publish_documents(settings, [])
    assert len(FailingProducer.stopped) == 2
