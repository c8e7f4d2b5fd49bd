"""Publishes records whose header key is not UTF-8, which aiokafka's consumer cannot parse.

aiokafka's producer only takes `str` header keys and encodes them itself, so this runs as its own
process with the pure-Python record builder (AIOKAFKA_NO_EXTENSIONS=1) and a key whose `encode`
returns invalid UTF-8, as a client in another language could send. Prints one JSON line per
record: topic, partition, offset.

    python -m tests.pipeline.poison_producer BOOTSTRAP TOPIC COUNT
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from aiokafka import AIOKafkaProducer

ROOT = Path(__file__).resolve().parents[2]


class _NotUtf8(str):
    __slots__ = ()

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return b"\xff\xfe-not-utf8"


async def _publish(bootstrap: str, topic: str, count: int) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for i in range(count):
            meta = await producer.send_and_wait(
                topic, f"poison {i}".encode(), key=b"poison", headers=[(_NotUtf8("x"), b"v")]
            )
            print(json.dumps({"topic": meta.topic, "partition": meta.partition, "offset": meta.offset}))
    finally:
        await producer.stop()


def publish_unparsable(bootstrap: str, topic: str, count: int) -> list[tuple[str, int, int]]:
    """Publishes `count` such records from a child process; their (topic, partition, offset)."""
    env = {**os.environ, "AIOKAFKA_NO_EXTENSIONS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "tests.pipeline.poison_producer", bootstrap, topic, str(count)],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    found = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [(f["topic"], f["partition"], f["offset"]) for f in found]


if __name__ == "__main__":
    asyncio.run(_publish(sys.argv[1], sys.argv[2], int(sys.argv[3])))
