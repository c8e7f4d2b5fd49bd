"""`deepanalyze run --workers N`: N worker processes in one consumer group on one host.

Kafka shares the partitions among them; nothing is distributed by hand. Each worker is a plain
`deepanalyze run` with its own engine (one per GPU: give each its own `CUDA_VISIBLE_DEVICES`) and
its own status port (`STATUS_PORT` + i; 0 stays "any free port"). SIGTERM/SIGINT are passed on
and the workers drain within `SHUTDOWN_GRACE_S`. A worker that crashes is restarted, at most
`max_restarts` times, after a growing pause; the exit status is the worst of the workers'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

log = logging.getLogger(__name__)


def worker_env(base: dict[str, str], index: int) -> dict[str, str]:
    env = dict(base)
    port = int(env.get("STATUS_PORT", "3000"))
    env["STATUS_PORT"] = str(port + index if port else 0)
    env.setdefault("KAFKA_CLIENT_ID", "deepanalyze")
    env["KAFKA_CLIENT_ID"] = f"{env['KAFKA_CLIENT_ID']}-{index}"
    return env


def stop_on_signals() -> asyncio.Event:
    """An event that SIGINT or SIGTERM sets (call from inside the running event loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def supervise(count: int, command: Sequence[str] | None = None, max_restarts: int = 5) -> int:
    """Runs `count` copies of `command` (default: this program's `run`) until SIGTERM/SIGINT."""
    argv = list(command or [sys.executable, "-m", "pipeline", "run"])
    stopping = stop_on_signals()
    codes = await asyncio.gather(*(_keep_running(argv, i, stopping, max_restarts) for i in range(count)))
    return max(codes)


async def _keep_running(argv: list[str], index: int, stopping: asyncio.Event, max_restarts: int) -> int:
    restarts = 0
    while True:
        process = await asyncio.create_subprocess_exec(*argv, env=worker_env(dict(os.environ), index))
        log.info("worker %d started (pid %d)", index, process.pid)
        waiting = asyncio.create_task(process.wait())
        stop = asyncio.create_task(stopping.wait())
        await asyncio.wait({waiting, stop}, return_when=asyncio.FIRST_COMPLETED)
        if stopping.is_set():
            stop.cancel()
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
            code = await waiting
            log.info("worker %d stopped with %d", index, code)
            return code
        stop.cancel()
        code = waiting.result()
        if code == 0:
            return 0
        if restarts >= max_restarts:
            log.error("worker %d exited with %d; %d restarts used, giving up", index, code, restarts)
            return code
        restarts += 1
        pause = min(30.0, 0.5 * 2**restarts)
        log.warning(
            "worker %d exited with %d; restart %d/%d in %.1f s", index, code, restarts, max_restarts, pause
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), pause)
        if stopping.is_set():
            return code
