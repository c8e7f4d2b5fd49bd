"""What the HTTP server refuses before a route runs: a Host header naming none of the allowed hosts
(400: DNS rebinding), a request without the bearer token or session cookie when HTTP_TOKEN is set
(401, or the login page for a browser), a body over HTTP_MAX_BODY_BYTES (413, refused on its
Content-Length before a byte is read) or slower than HTTP_BODY_TIMEOUT_S (408). Also the login
page that sets the session cookie, and 422s that JSON can carry.

Does not own the routes (`pipeline.http`, `pipeline.front`) nor the connection timeouts (uvicorn's
protocol, configured in `pipeline.http`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import html
import ipaddress
import math
import re
from dataclasses import dataclass
from importlib import resources
from string import Template
from typing import Annotated, Any
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from pydantic import BaseModel, SecretStr
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.settings import Settings

COOKIE = "deepanalyze_session"
# The probes; the login page, its look and the tab's icon.
OPEN_PATHS = frozenset(
    {"/livez", "/readyz", "/healthz", "/login", "/static/style.css", "/static/favicon.svg"}
)
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
_HOST = re.compile(r"(?P<host>[a-z0-9._-]+|\[[0-9a-f:.]+\])(?::[0-9]{1,5})?")
_PAGE_PATH = re.compile(r"/(?!/)[A-Za-z0-9_/-]*")  # where the login may send a browser back: no host


@dataclass(frozen=True)
class HttpGuard:
    """What the HTTP server enforces, derived once from Settings."""

    token: SecretStr | None
    allowed_hosts: tuple[str, ...]  # lower case, IPv6 in brackets; "*.example.com" a domain, "*" any
    max_body_bytes: int
    body_timeout_s: float
    header_timeout_s: float
    keep_alive_s: int

    @classmethod
    def from_settings(cls, settings: Settings) -> HttpGuard:
        bound = [] if settings.status_host in ("", "0.0.0.0", "::") else [settings.status_host]  # noqa: S104
        hosts = [_host_pattern(h) for h in [*bound, *settings.http_allowed_hosts]]
        # A JSON client may write a character as \uXXXX (6 bytes; Python's json.dumps does by default).
        max_body = settings.http_max_body_bytes or 6 * settings.max_document_chars + 16 * 1024
        return cls(
            token=settings.http_token,
            allowed_hosts=tuple(dict.fromkeys([*LOOPBACK_HOSTS, *hosts])),
            max_body_bytes=max_body,
            body_timeout_s=settings.http_body_timeout_s,
            header_timeout_s=settings.http_header_timeout_s,
            keep_alive_s=settings.http_keep_alive_s,
        )

    def session_cookie(self) -> str:
        """The cookie's value: derived from the token, so the cookie never carries the token itself."""
        if self.token is None:
            raise RuntimeError("no HTTP_TOKEN, no session")
        key = self.token.get_secret_value().encode()
        return hmac.new(key, b"deepanalyze session v1", hashlib.sha256).hexdigest()

    def is_token(self, candidate: str) -> bool:
        # Digests compared: equal lengths, so the comparison's time says nothing about the token.
        expected = self.token.get_secret_value() if self.token is not None else None
        return expected is not None and hmac.compare_digest(_digest(candidate), _digest(expected))

    def is_session(self, cookie: str) -> bool:
        return self.token is not None and hmac.compare_digest(_digest(cookie), _digest(self.session_cookie()))

    def responses(self, *, authenticated: bool = True) -> dict[int | str, dict[str, Any]]:
        """The refusals a route can answer, for its OpenAPI entry."""
        found: dict[int | str, dict[str, Any]] = {
            400: {"model": Refusal, "description": "The Host header names none of the allowed hosts."},
            408: {"model": Refusal, "description": "The body did not arrive within HTTP_BODY_TIMEOUT_S."},
            413: {"model": Refusal, "description": "The body is longer than HTTP_MAX_BODY_BYTES."},
        }
        if authenticated and self.token is not None:
            found[401] = {"model": Refusal, "description": "No valid bearer token (HTTP_TOKEN) or session."}
        return found

    def protect(self, app: FastAPI) -> None:
        """Adds the checks to `app`, outermost first: Host, then token, then body."""
        app.exception_handler(BodyRefused)(_refused)
        app.exception_handler(RequestValidationError)(_invalid)
        app.add_middleware(BodyLimit, max_bytes=self.max_body_bytes, timeout_s=self.body_timeout_s)
        if self.token is not None:
            app.include_router(login_router(self))
            app.add_middleware(TokenAuth, guard=self)
        app.add_middleware(HostCheck, allowed=self.allowed_hosts)


class Refusal(BaseModel):
    detail: str


class HostCheck:
    """400 unless the Host header names an allowed host (any port)."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]) -> None:
        self.app, self.allowed = app, allowed

    def allows(self, header: str | None) -> bool:
        match = _HOST.fullmatch((header or "").lower())
        if match is None:
            return False
        host = match["host"]
        return any(p in ("*", host) or (p.startswith("*.") and host.endswith(p[1:])) for p in self.allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.allows(Headers(scope=scope).get("host")):
            response = JSONResponse({"detail": "this server does not answer to that Host"}, status_code=400)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class TokenAuth:
    """Every path but OPEN_PATHS needs `Authorization: Bearer <token>` or the session cookie.
    A browser asking for a page goes to the login page; anything else gets a 401."""

    def __init__(self, app: ASGIApp, guard: HttpGuard) -> None:
        self.app, self.guard = app, guard

    def is_authorized(self, request: Request) -> bool:
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and self.guard.is_token(credentials.strip()):
            return True
        return self.guard.is_session(request.cookies.get(COOKIE, ""))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        if self.is_authorized(request):
            await self.app(scope, receive, send)
            return
        response: Response
        if request.method in ("GET", "HEAD") and "text/html" in request.headers.get("accept", ""):
            path = scope["path"] if _PAGE_PATH.fullmatch(scope["path"]) else "/"
            response = RedirectResponse(f"/login?next={quote(path)}", status_code=303)
        else:
            detail = "authentication required: Authorization: Bearer <HTTP_TOKEN>, or log in at /login"
            response = JSONResponse({"detail": detail}, 401, {"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class BodyRefused(HTTPException):
    """Raised from `receive` when a body is too long or too slow; answered by `_refused`."""

    def __init__(self, status_code: int, error: str, detail: str) -> None:
        super().__init__(status_code, detail)
        self.error = error


class BodyLimit:
    """A Content-Length over `max_bytes` is refused before the body is read; a body without one
    (chunked) is counted as it arrives and cut at the limit; the whole body must arrive within
    `timeout_s` of the request, or 408 (a body trickled a byte at a time holds a connection)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        # h11 has refused a malformed one already; the checks only keep int() from raising.
        declared = declared if declared.isascii() and declared.isdigit() else ""
        if declared and (len(declared) > 18 or int(declared) > self.max_bytes):
            await _refusal(self.too_long())(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        received, finished = 0, False

        async def bounded() -> Message:
            nonlocal received, finished
            if finished:  # after the body: only http.disconnect, which may rightly wait for ever
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise BodyRefused(408, "timeout", f"the body took over {self.timeout_s:g} s") from None
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise self.too_long()
            finished = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, bounded, send)

    def too_long(self) -> BodyRefused:
        return BodyRefused(413, "too_long", f"the request body is longer than {self.max_bytes} bytes")


def _refusal(exc: BodyRefused) -> JSONResponse:
    # Connection: close, for the client may still be sending the body nobody will read.
    body = {"error": exc.error, "detail": exc.detail}
    return JSONResponse(body, status_code=exc.status_code, headers={"Connection": "close"})


async def _refused(request: Request, exc: BodyRefused) -> JSONResponse:
    return _refusal(exc)


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422, with NaN and ±Infinity in the echoed input written as strings: JSON has none."""
    return JSONResponse({"detail": _finite(jsonable_encoder(exc.errors()))}, status_code=422)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def _host_pattern(name: str) -> str:
    """As the Host header writes it, without a port: IPv6 in brackets."""
    bare = name.lower().strip("[]")
    with contextlib.suppress(ValueError):
        return f"[{ipaddress.IPv6Address(bare)}]"
    return bare.partition(":")[0]


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "replace")).digest()


def login_router(guard: HttpGuard) -> APIRouter:
    """GET /login: the form; POST /login (the token): the session cookie, then back to the page."""
    api = APIRouter(include_in_schema=False)
    page = Template((resources.files("pipeline") / "web" / "login.html").read_text(encoding="utf-8"))

    def form(next_page: str, error: str = "", status_code: int = 200) -> HTMLResponse:
        shown = f'<div class="error" role="alert">{html.escape(error)}</div>' if error else ""
        return HTMLResponse(page.substitute(next=html.escape(next_page), error=shown), status_code)

    @api.get("/login")
    async def login_form(next_page: Annotated[str, Query(alias="next")] = "/") -> HTMLResponse:
        return form(next_page if _PAGE_PATH.fullmatch(next_page) else "/")

    @api.post("/login")
    async def login(request: Request) -> Response:
        fields = parse_qs((await request.body()).decode("utf-8", "replace"))
        token, next_page = fields.get("token", [""])[0], fields.get("next", ["/"])[0]
        next_page = next_page if _PAGE_PATH.fullmatch(next_page) else "/"
        if not guard.is_token(token):
            return form(next_page, "令牌无效 · Wrong token", 401)
        response = RedirectResponse(next_page, status_code=303)
        forwarded = request.headers.get("x-forwarded-proto", "").split(",")[0].strip()
        secure = "https" in (request.url.scheme, forwarded)  # a proxy's word only adds a restriction
        response.set_cookie(
            COOKIE, guard.session_cookie(), path="/", httponly=True, samesite="strict", secure=secure
        )
        return response

    return api
