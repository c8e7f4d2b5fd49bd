"""Wires one worker together: settings -> model -> engine (or a model server) -> service + status
server.

Used by `deepanalyze run` and the demo; tests wire the pieces themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from engine import Engine, select_device, self_test
from pipeline.analyzer import AnalysisEngine
from pipeline.answers import AnswerHub
from pipeline.backends import EmbeddedBackend
from pipeline.bundled_models import MODELS, is_prepared, model_folder, prepare_model
from pipeline.front import Front, router
from pipeline.http import serve_status
from pipeline.http_guard import HttpGuard
from pipeline.openai_backend import OpenAIBackend
from pipeline.service import Service, unless_stopped
from pipeline.settings import Settings
from pipeline.telemetry import Telemetry, setup_telemetry

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _progress_bar(name: str) -> Iterator[Callable[[int, int], None]]:
    columns = (TextColumn(f"reassembling + verifying the {name} model"), BarColumn(), DownloadColumn())
    with Progress(*columns, TimeRemainingColumn(), transient=False) as progress:
        task = progress.add_task("model", total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield update


def resolve_model_path(settings: Settings) -> Path:
    """MODEL_PATH, or the bundled MODEL (converted on first use, with a progress bar)."""
    if settings.model_path is not None:
        return settings.model_path
    model = MODELS[settings.model]
    if is_prepared(folder := model_folder(model, settings.model_cache_dir), model):
        return folder
    with _progress_bar(model.name) as progress:
        return prepare_model(model.name, settings.model_cache_dir, progress)


async def serve(
    settings: Settings,
    stop: asyncio.Event,
    *,
    telemetry: Telemetry | None = None,
    on_ready: Callable[[Service, int], None] | None = None,
) -> None:
    """Runs one worker until `stop` is set. The start-up steps run in threads, which a stop cannot
    interrupt (the process waits for them before it exits), so `stop` is looked at after each: a
    SIGTERM during start-up costs the step under way, not the model load and a broker wait too."""
    owned = telemetry is None
    telemetry = telemetry or setup_telemetry(settings)
    try:
        await _serve(settings, stop, telemetry, on_ready)
    finally:
        if owned:  # buffered spans are exported before the process ends
            await asyncio.to_thread(telemetry.shutdown)


async def _serve(
    settings: Settings,
    stop: asyncio.Event,
    telemetry: Telemetry,
    on_ready: Callable[[Service, int], None] | None,
) -> None:
    if settings.analyzer_backend == "openai":
        server = OpenAIBackend.from_settings(settings)
        try:
            if not await unless_stopped(stop, server.start()):
                log.info("stopped during start-up, while reaching the model server")
                return
            log.info("model %s on the server at %s", server.model_id, settings.openai_base_url)
            await _run(settings, stop, telemetry, on_ready, server)
        finally:
            await server.close()
        return
    await asyncio.to_thread(self_test, select_device(settings.device))
    if _stopped(stop, "the engine self-test"):
        return
    model_path = await asyncio.to_thread(resolve_model_path, settings)
    if _stopped(stop, "finding the model"):
        return
    engine = await asyncio.to_thread(Engine.from_config, settings.engine_config(model_path))
    if _stopped(stop, "loading the model"):
        return
    async with engine:
        await _run(settings, stop, telemetry, on_ready, EmbeddedBackend(engine))


async def _run(
    settings: Settings,
    stop: asyncio.Event,
    telemetry: Telemetry,
    on_ready: Callable[[Service, int], None] | None,
    model: AnalysisEngine,
) -> None:
    """The service and its status server on `model`, until `stop`."""
    service = Service(settings, model, telemetry)
    hub = AnswerHub(settings)
    front = Front(settings, hub, tracer=telemetry.tracer, broker_reachable=service.broker_reachable)
    status = serve_status(
        service.status,
        settings.status_host,
        settings.status_port,
        service.metrics.render,
        router(front),
        guard=HttpGuard.from_settings(settings),
    )
    async with status as port:
        log.info("pages and status on http://%s:%d/", settings.status_host, port)
        if on_ready is not None:
            on_ready(service, port)
        try:
            await service.run(stop)
        finally:
            await hub.close()
            await front.close()
            service.metrics.shutdown()


def _stopped(stop: asyncio.Event, step: str) -> bool:
    if stop.is_set():
        log.info("stopped during start-up, after %s", step)
    return stop.is_set()
