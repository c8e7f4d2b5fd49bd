"""The broker the project starts for itself (`deepanalyze broker`, `make demo`, the tests, the load
test): Apache Kafka in KRaft mode when Java and the pinned jars are here, else the Tansu emulator,
saying why. `EMBEDDED_BROKER=kafka` insists on Apache Kafka (an error where it is missing);
`EMBEDDED_BROKER=tansu` picks the emulator. A Kafka of your own: KAFKA_BOOTSTRAP_SERVERS.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from pipeline.kafka_broker import KafkaUnavailable, free_port, kafka_cluster, unavailable_reason
from pipeline.tansu import BrokerError, tansu_broker

log = logging.getLogger(__name__)

__all__ = ["Broker", "BrokerError", "embedded_broker", "free_port"]

KINDS = ("auto", "kafka", "tansu")


class Broker(Protocol):
    @property
    def kind(self) -> str:
        """What it is, in words, for the first lines of the demo and of reports."""

    @property
    def durable(self) -> bool:
        """Whether topics, records and offsets survive stop() and start()."""

    @property
    def idempotent(self) -> bool:
        """Whether it accepts idempotent producers (KAFKA_ENABLE_IDEMPOTENCE must be false if not)."""

    @property
    def bootstrap_servers(self) -> str: ...

    @property
    def port(self) -> int: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def kill(self) -> None: ...

    def output(self) -> str: ...


def chosen_kind(kind: str | None = None) -> str:
    """`kind`, else EMBEDDED_BROKER, else auto: Apache Kafka where it can start, Tansu otherwise."""
    wanted = (kind or os.environ.get("EMBEDDED_BROKER") or "auto").strip().lower()
    if wanted not in KINDS:
        raise BrokerError(f"EMBEDDED_BROKER={wanted!r}: expected one of {', '.join(KINDS)}")
    if wanted != "auto":
        return wanted
    reason = unavailable_reason()
    if reason is None:
        return "kafka"
    log.warning("Apache Kafka cannot start here: %s. Falling back to the Tansu emulator (in memory).", reason)
    return "tansu"


@contextlib.contextmanager
def embedded_broker(
    port: int | None = None,
    host: str = "127.0.0.1",
    advertised_port: int | None = None,
    *,
    kind: str | None = None,
    folder: Path | None = None,
) -> Iterator[Broker]:
    """One broker on `host` for the body of the block. `folder` keeps Apache Kafka's data there
    (reused when started again); without it the data lives in a temporary folder."""
    chosen = chosen_kind(kind)
    if chosen == "kafka":
        try:
            with kafka_cluster(
                1, port=port, host=host, advertised_port=advertised_port, folder=folder
            ) as cluster:
                yield cluster
        except KafkaUnavailable as error:
            raise BrokerError(str(error)) from error
    else:
        with tansu_broker(port, host, advertised_port) as broker:
            yield broker
