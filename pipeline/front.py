"""The front end's API and pages: `POST /api/analyze`, `GET /api/events`, `/` and `/triage`.

Everything goes through the real path: the document is published to its input topic like any
other producer's, a worker analyses it, and the answer is read back from the answer topics
(`AnswerHub`), so the page shows exactly what downstream consumers get. The pages are static files
in `pipeline/web/`, served from here: nothing is fetched from the internet.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from fastapi import APIRouter, Header, Query
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from opentelemetry import trace
from pydantic import BaseModel, Field

from pipeline.answers import AnswerHub, Delivered
from pipeline.client import send_document
from pipeline.kafka import make_producer
from pipeline.settings import Settings
from schemas import PROGRESS_HEADER, AnalysisEvent, DocumentEvent, DocumentKind, Language
from schemas.events import NonEmptyStr
from schemas.kinds import KindName

log = logging.getLogger(__name__)

STATIC = Path(str(resources.files("pipeline") / "web"))
_EVENT_ID = re.compile(r"[0-9]{1,18}")  # a Last-Event-ID we could have sent


class AnalyzeRequest(BaseModel):
    text: NonEmptyStr = Field(description="The document. Longer than MAX_DOCUMENT_CHARS: 413.")
    kind: KindName = Field(
        default=DocumentKind.COMPLAINT.value,
        description="One of the worker's kinds (built in or KINDS_FILE's).",
    )
    language: Language | None = Field(default=None, description="Detected from the text when absent.")
    wait: bool = Field(default=True, description="Wait for the analysis (200), or return at once (202).")
    timeout_s: float = Field(default=120.0, ge=1, le=900, description="How long to wait before 504.")


class Accepted(BaseModel):
    event_id: str = Field(description="The answer's id: follow it with GET /api/events?event_id=...")
    document_id: str
    topic: str
    partition: int
    offset: int


class ErrorBody(BaseModel):
    error: Literal["too_long", "broker_unavailable", "timeout", "analysis_failed"]
    detail: str
    event_id: str | None = None
    reason: str | None = None


class Unparsable(BaseModel):
    detail: str


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": Unparsable, "description": "The body is not JSON."},
    413: {"model": ErrorBody, "description": "The document is longer than MAX_DOCUMENT_CHARS."},
    502: {"model": ErrorBody, "description": "The document was dead-lettered (e.g. the model failed)."},
    503: {"model": ErrorBody, "description": "The broker cannot be reached; nothing was published."},
    504: {"model": ErrorBody, "description": "No answer within timeout_s; it may still come on /api/events."},
}


def _error(status: int, error: str, detail: str, **extra: str | None) -> JSONResponse:
    body = ErrorBody(error=error, detail=detail, **extra)  # type: ignore[arg-type]
    return JSONResponse(body.model_dump(exclude_none=True), status_code=status)


class Front:
    """The producer the pages publish with (started on first use) and the answer hub."""

    def __init__(
        self,
        settings: Settings,
        hub: AnswerHub,
        send_timeout_s: float = 10.0,
        tracer: trace.Tracer | None = None,  # the worker's: a page's document starts its trace
        broker_reachable: Callable[[], bool | None] = lambda: None,  # None: not known (yet)
    ) -> None:
        self.settings, self.hub, self.send_timeout_s = settings, hub, send_timeout_s
        self.tracer = tracer
        self.broker_reachable = broker_reachable
        self._producer: AIOKafkaProducer | None = None
        self._lock = asyncio.Lock()

    async def producer(self) -> AIOKafkaProducer:
        async with self._lock:
            if self._producer is None:
                timeout_ms = int(self.send_timeout_s * 1000)  # one document, sent at once
                producer = make_producer(self.settings, request_timeout_ms=timeout_ms, linger_ms=0)
                try:
                    await asyncio.wait_for(producer.start(), self.send_timeout_s)
                except BaseException:
                    await producer.stop()
                    raise
                self._producer = producer
            return self._producer

    async def publish(self, request: AnalyzeRequest) -> Accepted:
        document = DocumentEvent(
            document_id=f"web-{uuid.uuid4().hex[:12]}",
            kind=request.kind,
            text=request.text,
            language=request.language,
            source_system="web",
        )
        producer = await self.producer()
        sent = await asyncio.wait_for(
            send_document(
                producer, self.settings, document, tracer=self.tracer, headers=[(PROGRESS_HEADER, b"1")]
            ),
            self.send_timeout_s,
        )
        return Accepted(event_id=sent.event_id, document_id=sent.document_id, topic=sent.topic,
                        partition=sent.partition, offset=sent.offset)  # fmt: skip

    async def close(self) -> None:
        if self._producer is not None:
            await self._producer.stop()


def _state(reachable: bool | None) -> bytes:
    """The board's live indicator: whether the worker reaches the broker (also a keep-alive)."""
    broker = {True: "up", False: "down", None: "unknown"}[reachable]
    return f'event: state\ndata: {{"broker": "{broker}"}}\n\n'.encode()


def _sse(item: Delivered) -> bytes:
    return f"id: {item.seq}\nevent: {item.kind}\ndata: {item.json}\n\n".encode()


def router(front: Front) -> APIRouter:
    api = APIRouter()
    max_chars = front.settings.max_document_chars

    @api.post("/api/analyze", response_model=AnalysisEvent, responses={202: {"model": Accepted}, **ERRORS})
    async def analyze(request: AnalyzeRequest) -> Any:
        """Publishes the document to its input topic and returns its analysis event as it lands."""
        if len(request.text) > max_chars:
            return _error(
                413,
                "too_long",
                f"the document has {len(request.text)} characters; the limit is {max_chars}. "
                "Shorten it, or send it in parts.",
            )
        if request.kind not in front.settings.kinds:  # a validation error of the body, as any other
            known = ", ".join(front.settings.kinds)
            problem = {"loc": ("body", "kind"), "msg": f"not a kind of this worker: one of {known}",
                       "type": "value_error", "input": request.kind}  # fmt: skip
            raise RequestValidationError([problem])
        try:
            accepted = await front.publish(request)
        except (KafkaError, OSError, TimeoutError) as exc:
            servers = front.settings.kafka_bootstrap_servers
            log.warning("a page's document was not published (%s): %s: %s", servers, type(exc).__name__, exc)
            return _error(
                503,
                "broker_unavailable",
                "the message bus cannot be reached right now, so nothing was sent. "
                "Try again in a minute; if it persists, tell whoever runs the service.",
            )
        if not request.wait:
            return JSONResponse(accepted.model_dump(), status_code=202)
        # Its own answer: the id and the document this request published (never another's answer
        # under the same id).
        found = await front.hub.wait_for(accepted.event_id, request.timeout_s, accepted.document_id)
        if found is None:
            return _error(
                504,
                "timeout",
                f"no answer within {request.timeout_s:g} s; it may still arrive on "
                f"/api/events?event_id={accepted.event_id}",
                event_id=accepted.event_id,
            )
        if found.kind == "dead_letter":
            letter = json_of(found)
            return _error(
                502,
                "analysis_failed",
                str(letter.get("error_message", "")),
                event_id=accepted.event_id,
                reason=str(letter.get("error_type")),
            )
        return JSONResponse(json_of(found))

    @api.get(
        "/api/events",
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}, "description": "Server-sent events."}},
    )
    async def events(
        event_id: Annotated[str | None, Query(description="Only this answer, then the stream ends.")] = None,
        replay: Annotated[int, Query(ge=0, le=2_000, description="Recent answers to send first.")] = 0,
        last_event_id: Annotated[str | None, Header(description="Set by EventSource on reconnect.")] = None,
    ) -> StreamingResponse:
        """Analysis events (`event: analysis`) and dead letters (`event: dead_letter`) as they land;
        with `event_id`, that document's analysis as it is written first (`event: partial`)."""
        # Our ids are ASCII digits; anything else ("²", 5,000 digits, garbage) is no id: start afresh.
        after = int(last_event_id) if last_event_id and _EVENT_ID.fullmatch(last_event_id) else None

        async def stream() -> AsyncIterator[bytes]:
            yield b"retry: 2000\n\n"
            if event_id is not None:  # the analysis as it is written (`partial`), then the answer
                async for item in front.hub.watch(event_id, 15.0):
                    if item is None:
                        yield b": waiting\n\n"  # keeps proxies from closing an idle stream
                    elif item.kind == "partial":
                        yield f"event: partial\ndata: {item.json}\n\n".encode()  # no id: not an answer
                    else:
                        yield _sse(item)
                return  # the answer, or the worker stops: the page's EventSource reconnects elsewhere
            yield _state(front.broker_reachable())
            async for item in front.hub.follow(after, replay, heartbeat_s=5.0):
                yield _state(front.broker_reachable()) if item is None else _sse(item)

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

    @api.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @api.get("/triage", include_in_schema=False)
    async def triage() -> FileResponse:
        return FileResponse(STATIC / "triage.html")

    @api.get("/api/kinds")
    async def kinds() -> list[dict[str, Any]]:
        """The kinds this worker analyses: built in and KINDS_FILE's, with their own fields."""
        return [
            {"name": k.name, "title": k.title.model_dump(), "triage": k.triage, "fields": list(k.fields)}
            for k in front.settings.kinds.values()
        ]

    @api.get("/api/limits")
    async def limits() -> dict[str, int]:
        """What the page checks before sending."""
        return {"max_document_chars": max_chars}

    return api


def json_of(item: Delivered) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(item.json)
    return value
