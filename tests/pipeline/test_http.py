from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine import Engine, SamplingParams
from engine.tiny import build_tiny
from pipeline.backends import EmbeddedBackend
from pipeline.front import Front, router
from pipeline.http import serve_status
from pipeline.http_guard import HttpGuard
from pipeline.service import Service
from pipeline.settings import SettingsError, load_settings
from pipeline.telemetry import Telemetry
from tests.pipeline.fakes import ScriptedEngine


@pytest.mark.parametrize(("dynamic", "kv", "size"), [("true", "true", "5"), ("false", "false", "8")])
async def test_status_reflects_the_environment(
    monkeypatch: pytest.MonkeyPatch, telemetry: Telemetry, dynamic: str, kv: str, size: str
) -> None:
    monkeypatch.setenv("DYNAMIC_BATCHING", dynamic)
    monkeypatch.setenv("KV_COMPRESSION", kv)
    monkeypatch.setenv("MAX_BATCH_SIZE", size)
    settings = load_settings()
    engine = ScriptedEngine(
        model_id="m-1", config=settings.engine_config(Path("m-1"))
    )  # as the app builds it
    service = Service(settings, engine, telemetry)
    async with serve_status(service.status, "127.0.0.1", 0) as port, httpx.AsyncClient() as client:
        status = (await client.get(f"http://127.0.0.1:{port}/api/status")).json()
        health = await client.get(f"http://127.0.0.1:{port}/healthz")
        ready = await client.get(f"http://127.0.0.1:{port}/readyz")
        live = await client.get(f"http://127.0.0.1:{port}/livez")
    assert status["dynamic_batching"] is (dynamic == "true")
    assert status["kv_compression"] is (kv == "true")
    assert status["max_batch_size"] == int(size)
    assert status["model"] == "m-1"
    assert {"processed", "failed", "dead_lettered"} <= status.keys()
    assert status["kv_pool"]["total_bytes"] == 1024
    assert "batch_occupancy" in status["engine"]
    assert health.status_code == ready.status_code == 503  # not consuming yet: not ready...
    assert live.status_code == 200 and live.json() == {"status": "alive"}  # ...but alive
    assert status["grammars_ready"] is False


@pytest.mark.parametrize("kv", ["true", "false"])
async def test_kv_compression_switch_changes_status_and_the_engines_memory(
    monkeypatch: pytest.MonkeyPatch, telemetry: Telemetry, kv: str
) -> None:
    """KV_COMPRESSION reaches the real engine (tiny model): /api/status names the profile, and
    while a long prompt runs the pool holds fewer bytes per token than full precision."""
    monkeypatch.setenv("KV_COMPRESSION", kv)
    monkeypatch.setenv("KV_QUANT_BITS", "8")
    monkeypatch.setenv("KV_CACHE_BYTES", str(1 << 22))
    monkeypatch.setenv("DTYPE", "float32")
    settings = load_settings()
    engine = Engine(settings.engine_config(Path("unused")), build_tiny("qwen2"))
    service = Service(settings, EmbeddedBackend(engine), telemetry)
    ratios = []
    async with engine, serve_status(service.status, "127.0.0.1", 0) as port, httpx.AsyncClient() as client:
        prompt = engine.format_chat([{"role": "user", "content": "The invoice was wrong. " * 12}])
        handle = engine.submit(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
        while not handle.done:
            status = (await client.get(f"http://127.0.0.1:{port}/api/status")).json()
            if status["kv_pool"]["held_tokens"]:
                ratios.append(status["kv_pool"]["live_ratio"])
        await handle.result()
    assert status["kv_compression"] is (kv == "true")
    if kv == "true":
        profile = {"quant_bits": 8, "residual_tokens": 32, "sink_tokens": 4, "keep_ratio": 1.0}
        profile |= {"prompt_tokens": 0}  # KV_PROMPT_TOKENS: no full-precision room for prompts
        # KV_INT8_LAYERS, KV_INT6_LAYERS and KV_INT6_PARTS only matter at 4 bits
        profile |= {"int8_layers": [], "int6_layers": [], "int6_parts": []}
        reader = status["kv_profile"].pop("reader")
        assert reader == engine.stats().kv_reader and reader.startswith(("native-", "torch"))
        assert status["kv_profile"] == profile | {"prune_policy": "attention"}
        assert min(ratios) < 0.8
    else:
        assert status["kv_profile"] is None
        assert min(ratios) >= 1.0


# -- the HTTP side's defences (no broker: every request here is refused or answered before Kafka) ----

TOKEN = "t0ken-for-the-tests-0123456789abcdef"  # noqa: S105 (a test token)
TIMEOUT_S = 1.0  # header, body and keep-alive timeouts in these tests
SLACK_S = 1.5


class RecordingHub:
    """Stands in for AnswerHub on the event stream: records `after`, then sends heartbeats."""

    def __init__(self) -> None:
        self.after: list[int | None] = []
        self.closed = False

    async def follow(self, after: int | None, replay: int, heartbeat_s: float = 15.0) -> AsyncIterator[None]:
        self.after.append(after)
        while True:
            yield None
            await asyncio.sleep(0.2)

    async def wait_for(self, event_id: str, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)


@contextlib.asynccontextmanager
async def guarded(
    hub: RecordingHub | None = None, broker: bool | None = True, **overrides: object
) -> AsyncIterator[str]:
    """The full app (pages and API, /metrics) on loopback with short timeouts; yields its base URL."""
    settings = load_settings(
        status_port=0,
        http_header_timeout_s=TIMEOUT_S,
        http_body_timeout_s=TIMEOUT_S,
        http_keep_alive_s=int(TIMEOUT_S),
        **overrides,
    )
    front = Front(settings, hub or RecordingHub(), send_timeout_s=1.0, broker_reachable=lambda: broker)  # type: ignore[arg-type]
    web = router(front)
    guard = HttpGuard.from_settings(settings)
    ready = {"status": "ready"}
    async with serve_status(lambda: ready, "127.0.0.1", 0, lambda: b"# metrics\n", web, guard=guard) as port:
        yield f"http://127.0.0.1:{port}"
    await front.close()


async def _raw(url: str, sent: bytes, *, then: bytes = b"", pause_s: float = 0.0) -> tuple[bytes, float]:
    """Sends `sent` (and, `pause_s` later, `then`) on a raw connection; what came back until the
    server closed it, and how long after the first write that was."""
    port = int(url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        writer.write(sent)
        await writer.drain()
        if then:
            await asyncio.sleep(pause_s)
            writer.write(then)
            await writer.drain()
        received = await asyncio.wait_for(reader.read(), 10 * TIMEOUT_S)  # until EOF
    finally:
        writer.close()
    return received, loop.time() - started


def _status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def _json_of(response: bytes) -> dict[str, Any]:
    head, _, body = response.partition(b"\r\n\r\n")
    assert b"application/json" in head.lower(), head
    value: dict[str, Any] = json.loads(body)
    return value


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "worker.internal"])  # noqa: S104
async def test_a_bind_beyond_loopback_without_a_token_is_refused_at_start(host: str) -> None:
    with pytest.raises(SettingsError, match="HTTP_TOKEN") as refused:
        load_settings(status_host=host)
    assert "STATUS_HOST" in str(refused.value)
    with pytest.raises(SettingsError, match="HTTP_TOKEN"):
        async with serve_status(lambda: {}, host, 0):
            pass
    assert load_settings(status_host=host, http_token=TOKEN).status_host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "localhost", "::1", "[::1]"])
def test_loopback_binds_need_no_token(host: str) -> None:
    assert load_settings(status_host=host).http_token is None


def test_the_http_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "STATUS_HOST": "0.0.0.0",  # noqa: S104
        "HTTP_TOKEN": TOKEN,
        "HTTP_ALLOWED_HOSTS": "Analyst.example, fd00::1,",
        "HTTP_MAX_BODY_BYTES": "4096",
    }.items():
        monkeypatch.setenv(name, value)
    guard = HttpGuard.from_settings(load_settings())
    assert guard.token is not None and guard.token.get_secret_value() == TOKEN
    assert guard.allowed_hosts == ("localhost", "127.0.0.1", "[::1]", "analyst.example", "[fd00::1]")
    assert guard.max_body_bytes == 4096
    monkeypatch.delenv("HTTP_MAX_BODY_BYTES")
    assert HttpGuard.from_settings(load_settings(max_document_chars=1000)).max_body_bytes == 6000 + 16384


def test_a_short_token_is_refused_without_being_echoed() -> None:
    with pytest.raises(SettingsError, match="16 characters") as refused:
        load_settings(status_host="0.0.0.0", http_token="hunter2")  # noqa: S104
    assert "hunter2" not in str(refused.value)


async def test_with_a_token_every_route_but_healthz_needs_the_bearer_token() -> None:
    async with guarded(http_token=TOKEN) as url, httpx.AsyncClient(base_url=url) as client:
        routes = ["/api/status", "/metrics", "/openapi.json", "/api/limits", "/static/analyze.js"]
        for path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                refused = await client.get(path, headers=headers)
                assert refused.status_code == 401, (path, headers)
                assert refused.headers["www-authenticate"] == "Bearer" and refused.json()["detail"]
            allowed = await client.get(path, headers={"Authorization": f"Bearer {TOKEN}"})
            assert allowed.status_code == 200, path
        events = await client.get("/api/events", headers={"Accept": "text/event-stream"})
        analyze = await client.post("/api/analyze", json={"text": "hello"})
        assert events.status_code == analyze.status_code == 401
        assert (await client.get("/healthz")).json() == {"status": "ok"}  # kubelet probes carry no token
        assert (await client.get("/readyz")).json() == {"status": "ok"}
        assert (await client.get("/livez")).json() == {"status": "alive"}
        schema = (await client.get("/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})).json()
    assert {"400", "401", "413"} <= schema["paths"]["/api/status"]["get"]["responses"].keys()
    for probe in ("/healthz", "/readyz", "/livez"):
        assert "401" not in schema["paths"][probe]["get"]["responses"]


async def test_a_browser_logs_in_with_the_token_and_its_cookie_opens_the_pages_and_the_stream() -> None:
    page = {"Accept": "text/html,application/xhtml+xml"}
    async with guarded(http_token=TOKEN) as url, httpx.AsyncClient(base_url=url) as client:
        sent_away = await client.get("/triage", headers=page)
        assert sent_away.status_code == 303 and sent_away.headers["location"] == "/login?next=/triage"
        form = await client.get("/login?next=/triage")
        assert form.status_code == 200 and 'name="token"' in form.text and 'value="/triage"' in form.text
        wrong = await client.post("/login", data={"token": "nope", "next": "/triage"})
        assert wrong.status_code == 401 and "Wrong token" in wrong.text and not client.cookies
        login = await client.post("/login", data={"token": TOKEN, "next": "/triage"})
        assert login.status_code == 303 and login.headers["location"] == "/triage"
        cookie = login.headers["set-cookie"]
        assert TOKEN not in cookie
        assert {"httponly", "samesite=strict", "path=/"} <= {p.strip().lower() for p in cookie.split(";")}
        assert "secure" not in cookie.lower()  # plain http: a Secure cookie would never come back
        assert (await client.get("/triage", headers=page)).status_code == 200
        assert (await client.get("/api/status")).status_code == 200
        async with client.stream("GET", "/api/events") as stream:
            assert stream.status_code == 200
        # Behind a TLS proxy the cookie is Secure; `next` never leads off this server.
        proxied = await client.post(
            "/login", data={"token": TOKEN, "next": "//evil.example/"}, headers={"X-Forwarded-Proto": "https"}
        )
        assert proxied.headers["location"] == "/" and "secure" in proxied.headers["set-cookie"].lower()
        client.cookies.clear()
        assert (await client.get("/api/status")).status_code == 401


async def test_without_a_token_there_is_no_login_and_nothing_asks_for_one() -> None:
    async with guarded() as url, httpx.AsyncClient(base_url=url) as client:
        assert (await client.get("/api/status")).status_code == 200
        assert (await client.get("/", headers={"Accept": "text/html"})).status_code == 200
        assert (await client.get("/login")).status_code == 404


@pytest.mark.parametrize("token", [None, TOKEN])
async def test_a_host_header_naming_another_host_is_a_400_before_any_route(token: str | None) -> None:
    bearer = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        guarded(http_token=token, http_allowed_hosts="analyst.example, *.corp.example") as url,
        httpx.AsyncClient(base_url=url, headers=bearer) as client,
    ):
        port = url.rsplit(":", 1)[1]
        for host in ("evil.example", f"evil.example:{port}", "analyst.example.evil", "a@localhost", ""):
            for path in ("/healthz", "/api/status", "/login"):
                response = await client.get(path, headers={"Host": host})
                assert response.status_code == 400, (host, path)
                assert "Host" in response.json()["detail"]
        for host in (f"localhost:{port}", "127.0.0.1", f"[::1]:{port}", "Analyst.Example", "x.corp.example"):
            assert (await client.get("/api/status", headers={"Host": host})).status_code == 200, host


async def test_an_oversized_content_length_is_a_413_before_the_body_is_sent() -> None:
    headers = (
        b"POST /api/analyze HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000000\r\n\r\n"
    )
    async with guarded() as url:
        response, elapsed_s = await _raw(url, headers)  # not one byte of the 100 MB
    assert _status_of(response) == 413 and elapsed_s < TIMEOUT_S  # not the body timeout's 408
    assert _json_of(response)["error"] == "too_long"


async def test_a_chunked_body_over_the_limit_is_cut_at_the_limit_with_a_413() -> None:
    chunk = b'{"text": "' + b"x" * 4000
    head = b"POST /api/analyze HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(3))  # 12 kB, limit 8 kB
    async with guarded(http_max_body_bytes=8192) as url:
        response, _ = await _raw(url, head + chunks)  # never terminated: no 0-chunk follows
        within, _ = await _raw(url, head + chunks[: len(chunks) // 3] + b"0\r\n\r\n")
    assert _status_of(response) == 413 and _json_of(response)["error"] == "too_long"
    assert _status_of(within) == 422  # under the limit: parsed (and refused as the bad JSON it is)


async def test_a_body_slower_than_the_body_timeout_is_cut_with_a_408() -> None:
    head = b"POST /api/analyze HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n"
    async with guarded() as url:
        response, elapsed_s = await _raw(url, head + b'{"text":', then=b' "x', pause_s=TIMEOUT_S / 2)
    assert _status_of(response) == 408 and _json_of(response)["error"] == "timeout"
    assert TIMEOUT_S <= elapsed_s < TIMEOUT_S + SLACK_S


@pytest.mark.parametrize(
    ("sent", "then"),
    [(b"", b""), (b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n", b""), (b"GET /he", b"althz HTTP/1.1\r\n")],
    ids=["nothing", "incomplete-headers", "trickled-headers"],
)
async def test_a_connection_without_complete_headers_is_closed_after_the_header_timeout(
    sent: bytes, then: bytes
) -> None:
    async with guarded() as url:
        response, elapsed_s = await _raw(url, sent, then=then, pause_s=TIMEOUT_S * 0.7)
    assert response == b""
    assert TIMEOUT_S * 0.9 <= elapsed_s < TIMEOUT_S + SLACK_S


async def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout() -> None:
    async with guarded() as url:
        response, elapsed_s = await _raw(url, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert _status_of(response) == 200 and response.endswith(b'{"status":"ok"}')  # then silence
    assert TIMEOUT_S * 0.9 <= elapsed_s < TIMEOUT_S + SLACK_S


async def test_the_event_stream_outlives_every_timeout() -> None:
    async with guarded() as url, httpx.AsyncClient(base_url=url) as client:
        beats, started = 0, asyncio.get_running_loop().time()
        async with client.stream("GET", "/api/events") as stream:
            async for line in stream.aiter_lines():
                beats += line == "event: state"
                if asyncio.get_running_loop().time() - started > 3 * TIMEOUT_S:
                    break
    assert beats >= 10


@pytest.mark.parametrize(("reachable", "said"), [(True, "up"), (False, "down"), (None, "unknown")])
async def test_the_event_stream_says_whether_the_worker_reaches_the_broker(
    reachable: bool | None, said: str
) -> None:
    async with (
        guarded(broker=reachable) as url,
        httpx.AsyncClient(base_url=url) as client,
        client.stream("GET", "/api/events") as stream,
    ):
        lines = stream.aiter_lines()
        async for line in lines:
            if line == "event: state":
                assert json.loads((await anext(lines)).removeprefix("data: ")) == {"broker": said}
                break
        else:
            raise AssertionError("no state event")


@pytest.mark.parametrize(
    "value", ["\xb2".encode("latin-1"), b"1" * 5000, b"abc", b"-1", b"1e3", b"7.0", "٣".encode(), b"\xff\xfe"]
)
async def test_a_last_event_id_that_is_not_ours_is_ignored(value: bytes) -> None:
    hub = RecordingHub()
    async with guarded(hub) as url, httpx.AsyncClient(base_url=url) as client:
        async with client.stream("GET", "/api/events", headers={"Last-Event-ID": value}) as stream:
            assert stream.status_code == 200
            assert await anext(stream.aiter_lines()) == "retry: 2000"
        async with client.stream("GET", "/api/events", headers={"Last-Event-ID": "7"}) as stream:
            assert stream.status_code == 200
            await anext(stream.aiter_lines())
    assert hub.after[0] is None and hub.after[-1] == 7


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e309", "-1", "0"])
async def test_a_timeout_that_is_not_a_finite_number_in_range_is_a_422_in_json(value: str) -> None:
    body = f'{{"text": "hello", "timeout_s": {value}}}'
    async with guarded() as url, httpx.AsyncClient(base_url=url) as client:
        response = await client.post(
            "/api/analyze", content=body, headers={"Content-Type": "application/json"}
        )
    assert response.status_code == 422, response.text
    (error,) = response.json()["detail"]
    assert error["loc"] == ["body", "timeout_s"]


@pytest.mark.parametrize(
    "body", [b"not json", b"\xff\xfe\x00{", b'{"text": "x"', b"[" * 20_000, b'"just a string"', b""]
)
async def test_a_body_that_is_not_a_json_request_is_a_4xx_in_json(body: bytes) -> None:
    async with guarded() as url, httpx.AsyncClient(base_url=url) as client:
        response = await client.post(
            "/api/analyze", content=body, headers={"Content-Type": "application/json"}
        )
    assert response.status_code in (400, 422), response.text
    assert response.json()["detail"]
