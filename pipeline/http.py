"""The service's HTTP server: `GET /api/status` (JSON), the probes `GET /livez` and `GET /readyz`
(`/healthz`: readiness), `GET /metrics` (Prometheus),
`GET /openapi.json`, and, given the front end's router, the pages and their API (`pipeline.front`).

Binds to 127.0.0.1 unless configured; beyond loopback only with a token (`pipeline.http_guard`
checks Host, token and bodies). Connections end when idle (HTTP_KEEP_ALIVE_S), when their request
headers are not complete within HTTP_HEADER_TIMEOUT_S, and after a response that went out before
its request's body was read. Runs inside the service's event loop; leaves signal handling to the
service.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Generator
from typing import Any

import h11
import uvicorn
from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from pipeline.http_guard import HttpGuard
from pipeline.metrics import CONTENT_TYPE
from pipeline.settings import Settings, SettingsError

StatusSource = Callable[[], dict[str, Any]]
MetricsSource = Callable[[], bytes]


def create_app(
    status: StatusSource,
    metrics: MetricsSource | None = None,
    web: APIRouter | None = None,
    guard: HttpGuard | None = None,
) -> FastAPI:
    """The app; `guard` None: Settings' defaults (loopback, no token)."""
    guard = guard or HttpGuard.from_settings(Settings.model_construct())
    refusals = guard.responses()
    # No Swagger UI or ReDoc pages: they load their scripts from a CDN. The schema is at /openapi.json.
    app = FastAPI(title="DeepAnalyze", version="0.1.0", docs_url=None, redoc_url=None)
    if web is not None:
        from pipeline.front import STATIC

        app.include_router(web, responses=refusals)
        app.mount("/static", StaticFiles(directory=STATIC), name="static")

    if metrics is not None:

        @app.get("/metrics", responses=refusals)
        async def prometheus() -> Response:
            return Response(metrics(), media_type=CONTENT_TYPE)

    @app.get("/api/status", responses=refusals)
    async def api_status() -> dict[str, Any]:
        return status()

    # The probes are open to anyone who reaches the port (kubelet probes carry no token) and say
    # one word. Liveness: the worker's event loop answers (a restart would help); readiness: it
    # consumes (not while waiting for a broker, starting or draining, which a restart would not
    # help). /healthz is readiness under its older name (the image's HEALTHCHECK).
    open_route = guard.responses(authenticated=False)

    @app.get("/livez", responses=open_route)
    async def livez() -> JSONResponse:
        return JSONResponse({"status": "alive"})

    async def readiness() -> JSONResponse:
        ready = status().get("status") == "ready"
        return JSONResponse({"status": "ok" if ready else "starting"}, status_code=200 if ready else 503)

    app.get("/readyz", responses=open_route)(readiness)
    app.get("/healthz", responses=open_route)(readiness)

    guard.protect(app)
    return app


class _Config(uvicorn.Config):
    """uvicorn's Config plus the request-header deadline its h11 protocol lacks."""

    def __init__(self, app: ASGIApp, *, header_timeout_s: float, **options: Any) -> None:
        super().__init__(app, **options)
        self.header_timeout_s = header_timeout_s


class _H11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing two more kinds of connection: one whose request headers are
    not complete `header_timeout_s` after it opened or began them (uvicorn's keep-alive timer only
    runs between requests, so a client sending nothing, or a byte now and then, held a socket for
    ever), and one whose response went out before its request's body was read (413, 401: h11 would
    go on reading and discarding whatever the client still sends)."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.header_timeout_s = config.header_timeout_s if isinstance(config, _Config) else None
        self.header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # nothing, or only part of the next request's headers
            self._await_headers()
        elif self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.transport.close()

    def _await_headers(self) -> None:
        if self.header_deadline is None and self.header_timeout_s is not None:
            self.header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_too_late)

    def _headers_too_late(self) -> None:
        self.header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


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
    *,
    guard: HttpGuard | None = None,
) -> AsyncIterator[int]:
    """Serves the app for the body of the block; yields the bound port (port 0: any free).
    `guard` None: Settings' defaults (loopback, no token)."""
    guard = guard or HttpGuard.from_settings(Settings.model_construct(status_host=host))
    if guard.token is None and not Settings.is_loopback(host):  # Settings refuses it too; any caller
        raise SettingsError(f"STATUS_HOST {host} is beyond loopback: it needs HTTP_TOKEN")
    config = _Config(
        create_app(status, metrics, web, guard),
        host=host,
        port=port,
        log_level="warning",
        lifespan="off",
        http=_H11Protocol,
        ws="none",  # no route speaks WebSocket: an upgrade is a plain (guarded) request
        timeout_keep_alive=guard.keep_alive_s,
        timeout_graceful_shutdown=5,  # a connection that outlives the stop (a stream) is cut then
        header_timeout_s=guard.header_timeout_s,
        server_header=False,  # no version for a scanner to look up
    )
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
