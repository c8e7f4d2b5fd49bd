"""The service's HTTP server: `GET /api/status` (JSON), `GET /healthz`, `GET /metrics` (Prometheus),
`GET /openapi.json`, and, given the front end's router, the pages and their API (`pipeline.web`).

Binds to 127.0.0.1 unless configured. Runs inside the service's event loop; leaves signal
handling to the service.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Generator
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from pipeline.metrics import CONTENT_TYPE

StatusSource = Callable[[], dict[str, Any]]
MetricsSource = Callable[[], bytes]


def create_app(
    status: StatusSource, metrics: MetricsSource | None = None, web: APIRouter | None = None
) -> FastAPI:
    # No Swagger UI or ReDoc pages: they load their scripts from a CDN. The schema is at /openapi.json.
    app = FastAPI(title="DeepAnalyze", version="0.1.0", docs_url=None, redoc_url=None)
    if web is not None:
        from pipeline.web import STATIC

        app.include_router(web)
        app.mount("/static", StaticFiles(directory=STATIC), name="static")

    if metrics is not None:

        @app.get("/metrics")
        async def prometheus() -> Response:
            return Response(metrics(), media_type=CONTENT_TYPE)

    @app.get("/api/status")
    async def api_status() -> dict[str, Any]:
        return status()

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        ready = status().get("status") == "ready"
        return JSONResponse({"status": "ok" if ready else "starting"}, status_code=200 if ready else 503)

    return app


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # The service owns SIGINT/SIGTERM and stops this server itself.
        yield


@contextlib.asynccontextmanager
async def serve_status(
    status: StatusSource,
    host: str,
    port: int,
    metrics: MetricsSource | None = None,
    web: APIRouter | None = None,
) -> AsyncIterator[int]:
    """Serves the app for the body of the block; yields the bound port (port 0: any free)."""
    app = create_app(status, metrics, web)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
    server = _Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():  # uvicorn exits on a bind error instead of raising it
            raise RuntimeError(
                f"the status server could not listen on {host}:{port} (is STATUS_PORT in use?)"
            )
        await asyncio.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield int(bound)
    finally:
        server.should_exit = True
        await task
