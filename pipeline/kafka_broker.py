"""Apache Kafka, started by the project itself: one KRaft node (broker and controller in one
process) or a cluster of them, on loopback, from the pinned jars that `make install` resolved with
Maven into the user's cache folder (deploy/kafka/pom.xml). Nothing is downloaded here.

Each node keeps its log on disk in its own folder, so a node stopped or killed and started again
comes back with its topics, records, committed offsets and transactions, as a real deployment
does. The JVM is told to die with the process that started it (Linux's parent-death signal), so a
test run or a demo killed from outside leaves no broker behind.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

KAFKA_VERSION = "4.4.0"
_PR_SET_PDEATHSIG = 1

_BROKER_LOG4J = """\
status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = ${sys:kafka.logs.dir}/server.log
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.state.name = state.change.logger
logger.state.level = WARN
"""

_TOOLS_LOG4J = """\
status = warn
appender.err.type = Console
appender.err.name = err
appender.err.target = SYSTEM_ERR
appender.err.layout.type = PatternLayout
appender.err.layout.pattern = %p %m%n
rootLogger.level = WARN
rootLogger.appenderRef.err.ref = err
"""


class KafkaUnavailable(RuntimeError):
    """Java or the Kafka jars are missing here; the message says which and what to do."""


class KafkaStartError(RuntimeError):
    """A Kafka node did not start; the message carries the end of its log."""


def cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deepanalyze"


def kafka_libs() -> Path:
    """Where `make install` puts the jars (KAFKA_LIBS overrides it)."""
    if found := os.environ.get("KAFKA_LIBS"):
        return Path(found)
    return cache_home() / f"kafka-{KAFKA_VERSION}" / "libs"


def java_binary() -> Path:
    """The `java` of JAVA_HOME, else the one on PATH."""
    if home := os.environ.get("JAVA_HOME"):
        candidate = Path(home) / "bin" / "java"
        if candidate.is_file():
            return candidate
    if found := shutil.which("java"):
        return Path(found)
    raise KafkaUnavailable("no Java runtime (set JAVA_HOME or put `java` on PATH; Kafka needs Java 17+)")


def classpath() -> str:
    libs = kafka_libs()
    if not (libs / f"kafka_2.13-{KAFKA_VERSION}.jar").is_file():
        raise KafkaUnavailable(
            f"the Apache Kafka {KAFKA_VERSION} jars are not in {libs} (`make install` resolves them "
            "with Maven from deploy/kafka/pom.xml)"
        )
    return f"{libs}/*"


def unavailable_reason() -> str | None:
    """Why Apache Kafka cannot be started here, or None when it can."""
    try:
        java_binary()
        classpath()
    except KafkaUnavailable as error:
        return str(error)
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def java_command(main: str, *args: str, heap: str = "256m", logs: Path | None = None) -> list[str]:
    """`java` with the Kafka class path running `main`: a node logging to `logs`/server.log, or,
    without `logs`, a tool (the formatter, kafka-consumer-groups) warning on stderr."""
    if logs is None:
        log4j = kafka_libs().parent / "tools-log4j2.properties"
        text = _TOOLS_LOG4J
    else:
        log4j, text = logs / "log4j2.properties", _BROKER_LOG4J
    if not log4j.is_file() or log4j.read_text() != text:
        log4j.parent.mkdir(parents=True, exist_ok=True)
        log4j.write_text(text)
    options = [
        f"-Xmx{heap}",
        "-XX:+UseSerialGC",  # two cores here: no parallel collector threads fighting the workers
        "-XX:-UsePerfData",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={log4j}",
    ]
    if logs is not None:
        options.append(f"-Dkafka.logs.dir={logs}")
    return [str(java_binary()), *options, "-cp", classpath(), main, *args]


def run_tool(main: str, *args: str, timeout_s: float = 60.0) -> str:
    """Runs one of Kafka's command-line tools (e.g. ConsumerGroupCommand) and returns its stdout."""
    done = subprocess.run(  # noqa: S603 - our own class path and arguments
        java_command(main, *args),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{main} exited with {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done.stdout


def new_cluster_id() -> str:
    """A random cluster id in Kafka's form (url-safe base64 of 16 bytes), never one that begins with
    "-": `kafka-storage format -t -x…` reads such an id as an option and refuses to format (one id in
    64; it failed a CI run). Kafka's own `Uuid.randomUuid` draws again for the same reason."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


@dataclass
class KafkaNode:
    """One KRaft node: broker and controller in one JVM, its log in `folder`."""

    node_id: int
    folder: Path
    host: str = "127.0.0.1"
    port: int = field(default_factory=free_port)
    controller_port: int = field(default_factory=free_port)
    advertised_port: int | None = None  # what clients are told to connect to (a proxy's port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def voter(self) -> str:
        return f"{self.node_id}@{self.host}:{self.controller_port}"

    def properties(self, voters: str, replicas: int) -> dict[str, str | int]:
        quorum = min(replicas, 2)
        return {
            "process.roles": "broker,controller",
            "node.id": self.node_id,
            "controller.quorum.voters": voters,
            "listeners": f"PLAINTEXT://{self.host}:{self.port},CONTROLLER://{self.host}:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{self.host}:{self.advertised_port or self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.folder / "data"),
            "default.replication.factor": replicas,
            "min.insync.replicas": quorum,
            "offsets.topic.replication.factor": replicas,
            "transaction.state.log.replication.factor": replicas,
            "transaction.state.log.min.isr": quorum,
            "share.coordinator.state.topic.replication.factor": replicas,
            "share.coordinator.state.topic.min.isr": quorum,
            # A development broker: rebalances start at once, and tests may use short sessions
            # (Kafka's own floor is 6 s; the worker's default, 10 s, suits any Kafka).
            "group.initial.rebalance.delay.ms": 0,
            "group.min.session.timeout.ms": 1000,
        }

    def start(self, voters: str, replicas: int, cluster_id: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        config = self.folder / "server.properties"
        config.write_text("".join(f"{k}={v}\n" for k, v in self.properties(voters, replicas).items()))
        if not (self.folder / "data" / "meta.properties").is_file():
            format_ = java_command(
                "kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}", "-c", str(config)
            )
            done = subprocess.run(format_, capture_output=True, text=True, check=False)  # noqa: S603
            if done.returncode != 0:
                raise KafkaStartError(f"formatting node {self.node_id} failed: {done.stderr.strip()[-2000:]}")
        with open(self.folder / "stdout.log", "ab") as out:
            self.process = subprocess.Popen(  # noqa: S603 - our own class path and arguments
                java_command("kafka.Kafka", str(config), heap="768m", logs=self.folder),
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
                env={k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "OTEL_"))},
            )

    def listening(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=0.2):
            return True
        return False

    def stop(self, timeout_s: float = 30.0) -> None:
        """A controlled shutdown (SIGTERM: leadership handed over, logs flushed); kill after `timeout_s`."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def kill(self) -> None:
        """kill -9: no shutdown at all, as a crashed machine."""
        if self.process is None:
            return
        self.process.kill()
        self.process.wait()
        self.process = None

    def output(self) -> str:
        """The end of the node's log (for error messages)."""
        parts = []
        for name in ("stdout.log", "server.log"):
            path = self.folder / name
            if path.is_file():
                parts.append(path.read_text(errors="replace")[-1500:])
        return "\n".join(parts).strip()


@dataclass
class KafkaCluster:
    """`size` KRaft nodes on loopback, every node a voter; replication factor and min ISR follow
    the size (1 and 1 for one node; 3 and 2 for three). Data kept on disk across stop/start."""

    folder: Path
    size: int = 1
    host: str = "127.0.0.1"
    first_port: int | None = None  # the first node's client port (free ports otherwise)
    advertised_port: int | None = None
    cluster_id: str = field(default_factory=new_cluster_id)
    nodes: list[KafkaNode] = field(default_factory=list)

    kind = f"Apache Kafka {KAFKA_VERSION} (KRaft)"
    durable = True
    idempotent = True

    def __post_init__(self) -> None:
        if not self.nodes:
            self.nodes = [
                KafkaNode(
                    i + 1,
                    self.folder / f"node-{i + 1}",
                    self.host,
                    port=self.first_port if i == 0 and self.first_port is not None else free_port(self.host),
                    advertised_port=self.advertised_port if i == 0 else None,
                )
                for i in range(self.size)
            ]

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(node.bootstrap_servers for node in self.nodes)

    @property
    def port(self) -> int:
        """The first node's client port (what a proxy in front of a one-node cluster forwards to)."""
        return self.nodes[0].port

    @property
    def voters(self) -> str:
        return ",".join(node.voter for node in self.nodes)

    @property
    def replicas(self) -> int:
        return min(self.size, 3)

    def start(self, timeout_s: float = 90.0) -> None:
        for node in self.nodes:
            if node.process is None:
                node.start(self.voters, self.replicas, self.cluster_id)
        self.wait_listening(self.nodes, timeout_s)

    def start_node(self, node: KafkaNode, timeout_s: float = 90.0) -> None:
        node.start(self.voters, self.replicas, self.cluster_id)
        self.wait_listening([node], timeout_s)

    def wait_listening(self, nodes: Sequence[KafkaNode], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = list(nodes)
        while waiting:
            for node in list(waiting):
                if node.process is None or node.process.poll() is not None:
                    code = None if node.process is None else node.process.returncode
                    raise KafkaStartError(f"Kafka node {node.node_id} exited ({code}):\n{node.output()}")
                if node.listening():
                    waiting.remove(node)
            if waiting and time.monotonic() > deadline:
                self.stop()
                raise KafkaStartError(
                    f"Kafka node(s) {[n.node_id for n in waiting]} did not listen within {timeout_s:.0f} s:\n"
                    + waiting[0].output()
                )
            time.sleep(0.1)

    def stop(self) -> None:
        for node in self.nodes:
            if node.process is not None:
                node.process.terminate()  # all at once: each waits for the others' controllers
        for node in self.nodes:
            node.stop()

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()

    def output(self) -> str:
        return "\n".join(node.output() for node in self.nodes)


@contextlib.contextmanager
def kafka_cluster(
    size: int = 1,
    *,
    port: int | None = None,
    host: str = "127.0.0.1",
    advertised_port: int | None = None,
    folder: Path | None = None,
) -> Iterator[KafkaCluster]:
    """Started for the body of the block and stopped after it. Without `folder` the data lives in a
    temporary folder removed at the end; with one it is kept (and reused when started again)."""
    unavailable = unavailable_reason()
    if unavailable:
        raise KafkaUnavailable(unavailable)
    owned = folder is None
    root = Path(tempfile.mkdtemp(prefix="deepanalyze-kafka-")) if folder is None else folder
    cluster_id = _stored_cluster_id(root) or new_cluster_id()
    cluster = KafkaCluster(root, size, host, port, advertised_port, cluster_id)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        if owned:
            shutil.rmtree(root, ignore_errors=True)


def _stored_cluster_id(root: Path) -> str | None:
    meta = root / "node-1" / "data" / "meta.properties"
    if not meta.is_file():
        return None
    for line in meta.read_text().splitlines():
        if line.startswith("cluster.id="):
            return line.split("=", 1)[1].strip()
    return None
