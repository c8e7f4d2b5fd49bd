"""The load test's worker processes: each configuration's `deepanalyze run` (or a stand-in module)
with its topics, producer, answer collector and a watch on its memory and KV pool; started,
warmed up (unmeasured) and stopped by `bench.load_test`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from aiokafka import AIOKafkaProducer
from rich.progress import Progress

from bench import common
from bench.load_gen import Collector, CorpusDoc, Sender
from pipeline.kafka import client_options, ensure_topics
from pipeline.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 (http://127.0.0.1)
        return json.load(response)


async def wait_until_prepared(
    status_url: str | None, proc: subprocess.Popen[bytes], name: str, timeout_s: float = 600.0
) -> None:
    """Until the worker's /api/status says it is ready with every grammar compiled (a stand-in
    worker without a status endpoint is taken as prepared)."""
    deadline = time.monotonic() + timeout_s
    while status_url is not None:
        if proc.poll() is not None:
            raise RuntimeError(f"{name}: the worker exited with {proc.returncode} while starting")
        with contextlib.suppress(OSError, ValueError):
            status = await asyncio.to_thread(_get_json, status_url)
            if status.get("status") == "ready" and status.get("grammars_ready"):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: the worker was not ready within {timeout_s:.0f} s")
        await asyncio.sleep(0.5)


@dataclass
class Watch:
    """Peak RSS of the worker (with children) and peak KV pool use from its /api/status."""

    pid: int
    status_url: str | None
    peak_rss: float = 0.0
    kv_total: int | None = None
    kv_peak_used: int = 0
    samples: list[tuple[float, float, int | None]] = field(default_factory=list)  # (t, rss MiB, kv used)

    def sample(self) -> None:
        try:
            proc = psutil.Process(self.pid)
            rss = sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
        except psutil.Error:
            return
        used = None
        if self.status_url is not None:
            with contextlib.suppress(OSError, ValueError):
                pool = _get_json(self.status_url)["kv_pool"]
                self.kv_total, used = pool["total_bytes"], pool["used_bytes"]
                self.kv_peak_used = max(self.kv_peak_used, used)
        self.peak_rss = max(self.peak_rss, rss / 2**20)
        self.samples.append((time.time(), rss / 2**20, used))

    async def run(self, stop: asyncio.Event, every_s: float = 0.5) -> None:
        while not stop.is_set():
            await asyncio.to_thread(self.sample)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)


@contextlib.contextmanager
def worker(settings: Settings, module: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The worker process for one configuration; stopped with SIGTERM (then killed) on exit."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *(["run"] if module == "pipeline" else [])],
            cwd=ROOT, env=common.worker_env(settings), stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            yield proc
        finally:
            common.stop_process(proc, 60)


@dataclass
class Running:
    """One configuration's worker process with its topics, producer, answer collector and watch."""

    name: str
    proc: subprocess.Popen[bytes]
    sender: Sender
    collector: Collector
    watch: Watch
    stack: contextlib.AsyncExitStack

    async def close(self) -> None:
        await self.stack.aclose()


async def start_config(name: str, settings: Settings, module: str, out_dir: Path) -> Running:
    """Topics, producer, collector and the worker of one configuration, all started; `close()`
    stops them (the worker with SIGTERM and no grace: after a measurement every document sent has
    been answered or is past its deadline, so nothing still owed is abandoned)."""
    await ensure_topics(settings)
    stack = contextlib.AsyncExitStack()
    try:
        producer = AIOKafkaProducer(
            **client_options(settings), acks="all", linger_ms=2, enable_idempotence=False
        )
        await producer.start()
        stack.push_async_callback(producer.stop)
        collector, stop = Collector(settings), asyncio.Event()
        tasks = [asyncio.create_task(collector.run(stop))]

        async def stop_tasks() -> None:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)

        stack.push_async_callback(stop_tasks)
        proc = stack.enter_context(worker(settings, module, out_dir / f"worker-{name}.log"))
        url = None if module != "pipeline" else f"http://127.0.0.1:{settings.status_port}/api/status"
        watch = Watch(proc.pid, url)
        tasks.append(asyncio.create_task(watch.run(stop)))
    except BaseException:
        await stack.aclose()
        raise
    return Running(name, proc, Sender(settings, producer, name), collector, watch, stack)


async def warm_up(run: Running, corpus: list[CorpusDoc], progress: Progress) -> None:
    """Unmeasured: model load and self-test, every grammar compiled (the worker does it in the
    background and says so in /api/status), then one short document through the whole path."""
    task = progress.add_task(f"{run.name}: starting", total=None)
    await wait_until_prepared(run.watch.status_url, run.proc, run.name)
    progress.update(task, description=f"{run.name}: warm-up document")
    warm = await (await run.sender.send(min(corpus, key=lambda d: len(d.text)), "warm-up", -1))
    while not run.collector.resolve(warm):
        if run.proc.poll() is not None:
            raise RuntimeError(f"{run.name}: the worker exited with {run.proc.returncode} before answering")
        await asyncio.sleep(0.5)
    progress.remove_task(task)
