"""Kafka record bytes <-> documents and events.

Decoding resolves a record into a `Document` (id, kind, language filled in) or raises
`RecordError` with the dead-letter reason. Content type: the `content-type` header decides
(`application/json` or `text/plain`); without it, a value whose first non-blank character is `{`
is taken as JSON, anything else as plain text.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from prompts import detect_language
from schemas import (
    BUILT_IN_KINDS,
    DeadLetter,
    DeadLetterReason,
    DocumentEvent,
    Header,
    Language,
    SourceCoordinates,
    event_id_for,
)

JSON_TYPES = ("application/json",)
TEXT_TYPES = ("text/plain",)

MAX_DOCUMENT_ID_CHARS = 256  # as DocumentEvent.document_id; a longer key is named by its hash
# What a dead letter carries of a record besides its value: enough to recognise and replay it,
# never so much that the dead letter outgrows the topic's message limit (a key or the headers can
# be as large as the value).
KEY_BYTES_KEPT = 1024
HEADERS_KEPT = 64
HEADER_KEY_CHARS_KEPT = 256
HEADER_VALUE_BYTES_KEPT = 4096
HEADERS_BYTES_KEPT = 32 * 1024
MESSAGE_CHARS_KEPT = 2000
MODEL_OUTPUT_CHARS_KEPT = 64 * 1024
# Room left for the answer record's key, headers (content type, trace context) and batch overhead.
RECORD_OVERHEAD_BYTES = 4096


class RecordError(ValueError):
    """A record that cannot become a document; carries the dead-letter reason."""

    def __init__(self, reason: DeadLetterReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class RawRecord:
    """A consumed record as it came off the topic: where it lies and its bytes, nothing decoded."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...] = ()

    @classmethod
    def of(cls, record: Any) -> RawRecord:
        """From an aiokafka `ConsumerRecord`."""
        timestamp = record.timestamp if isinstance(record.timestamp, int) and record.timestamp >= 0 else None
        headers = tuple((str(k), None if v is None else bytes(v)) for k, v in record.headers or ())
        return cls(
            record.topic, record.partition, record.offset, timestamp, record.key, record.value, headers
        )

    @property
    def event_id(self) -> str:
        return event_id_for(self.topic, self.partition, self.offset, self.timestamp_ms, self.value)

    @property
    def source(self) -> SourceCoordinates:
        return SourceCoordinates(
            topic=self.topic, partition=self.partition, offset=self.offset, timestamp_ms=self.timestamp_ms
        )


@dataclass(frozen=True)
class Document:
    """A validated document with its defaults resolved, and where it came from."""

    event_id: str
    document_id: str
    kind: str  # one of the worker's kinds (`Settings.kinds`)
    language: Language
    text: str
    source: SourceCoordinates
    source_system: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def _header(headers: Any, name: str) -> str | None:
    for key, value in headers or ():
        if key.lower() == name and value is not None:
            return bytes(value[:256]).decode("utf-8", errors="replace").split(";")[0].strip().lower()
    return None


def document_id_from_key(key: bytes | None) -> str | None:
    """The id a plain-text document takes from its record key: the key as text, or, for a key too
    long to be an id (it names the answer record and every log line), its SHA-256."""
    if not key:
        return None
    text = key.decode("utf-8", errors="replace").strip()
    if not text:
        return None
    if len(text) > MAX_DOCUMENT_ID_CHARS:
        return f"key-sha256:{hashlib.sha256(key).hexdigest()}"
    return text


def decode_document(
    record: RawRecord, *, default_kind: str, max_chars: int, kinds: Collection[str] = BUILT_IN_KINDS
) -> Document:
    """The record's document: its kind the one it names (one of `kinds`) or its topic's."""
    value = record.value
    if value is None:
        raise RecordError(DeadLetterReason.EMPTY_TEXT, "the record has no value")
    try:
        body = value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordError(
            DeadLetterReason.NOT_UTF8, f"the value is not UTF-8: {exc.reason} at byte {exc.start}"
        ) from exc
    content_type = _header(record.headers, "content-type")
    is_json = content_type in JSON_TYPES or (content_type not in TEXT_TYPES and body.lstrip().startswith("{"))
    event = _parse_json(body) if is_json else None
    text = event.text if event else body.strip()
    if not text:
        raise RecordError(DeadLetterReason.EMPTY_TEXT, "the document text is empty")
    if len(text) > max_chars:
        raise RecordError(
            DeadLetterReason.TOO_LONG, f"the document has {len(text)} characters; the limit is {max_chars}"
        )
    kind = (event.kind if event and event.kind else None) or default_kind
    if kind not in kinds:
        raise RecordError(
            DeadLetterReason.SCHEMA_VIOLATION,
            f"kind {kind!r} is not one this worker knows ({', '.join(kinds)}; more come from KINDS_FILE)",
        )
    return Document(
        event_id=record.event_id,
        document_id=(event.document_id if event and event.document_id else None)
        or document_id_from_key(record.key)
        or f"{record.topic}/{record.partition}/{record.offset}",
        kind=kind,
        language=(event.language if event and event.language else None) or detect_language(text),
        text=text,
        source=record.source,
        source_system=event.source_system if event else None,
        metadata=dict(event.metadata) if event else {},
    )


def _parse_json(body: str) -> DocumentEvent:
    try:
        raw = json.loads(body)
    except json.JSONDecodeError as exc:
        raise RecordError(
            DeadLetterReason.INVALID_JSON, f"the value is not valid JSON: {exc.msg} at {exc.pos}"
        ) from exc
    except RecursionError as exc:
        raise RecordError(DeadLetterReason.INVALID_JSON, "the value's JSON is nested too deeply") from exc
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise RecordError(DeadLetterReason.INVALID_JSON, f"the value's JSON is unreadable: {exc}") from exc
    if isinstance(raw, dict) and isinstance(raw.get("text"), str) and not raw["text"].strip():
        raise RecordError(DeadLetterReason.EMPTY_TEXT, "the document text is empty")
    try:
        return DocumentEvent.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in exc.errors()[:10]
        )
        raise RecordError(DeadLetterReason.SCHEMA_VIOLATION, f"not a DocumentEvent: {problems}") from exc
    except RecursionError as exc:
        raise RecordError(DeadLetterReason.SCHEMA_VIOLATION, "the document is nested too deeply") from exc


def _b64(data: bytes | None) -> str | None:
    return base64.b64encode(data).decode("ascii") if data is not None else None


def _kept_headers(headers: Any) -> tuple[list[Header], bool]:
    """The record's headers, bounded in number and size; and whether anything was left out."""
    kept: list[Header] = []
    cut = False
    total = 0
    for index, (key, value) in enumerate(headers or ()):
        raw = None if value is None else bytes(value)
        short_key = key[:HEADER_KEY_CHARS_KEPT]
        short = None if raw is None else raw[:HEADER_VALUE_BYTES_KEPT]
        total += len(short_key.encode("utf-8", errors="replace")) + len(short or b"")
        if index >= HEADERS_KEPT or total > HEADERS_BYTES_KEPT:
            return kept, True
        cut = cut or short_key != key or short != raw
        kept.append(Header(key=short_key, value_b64=_b64(short)))
    return kept, cut


def dead_letter(
    record: RawRecord,
    *,
    reason: DeadLetterReason,
    message: str,
    attempts: int = 0,
    document_id: str | None = None,
    raw_model_output: str | None = None,
    trace_id: str | None = None,
    max_value_bytes: int = 512 * 1024,
    max_message_bytes: int = 1_000_000,
) -> DeadLetter:
    """The dead letter for a record, always smaller than `max_message_bytes` as JSON.

    The value travels whole up to `max_value_bytes` and as far as the message limit allows (base64
    adds a third); beyond that only its first bytes, its length and SHA-256, and the coordinates
    where the original still lies. Key and headers are bounded the same way."""
    key, value = record.key, record.value
    kept_key = key if key is None or len(key) <= KEY_BYTES_KEPT else key[:KEY_BYTES_KEPT]
    headers, headers_cut = _kept_headers(record.headers)
    letter = DeadLetter(
        event_id=record.event_id,
        document_id=document_id,
        source=record.source,
        key_b64=_b64(kept_key),
        key_bytes=None if key is None else len(key),
        key_sha256=None if key is None else hashlib.sha256(key).hexdigest(),
        key_truncated=kept_key is not key,
        value_b64=None,
        value_bytes=None if value is None else len(value),
        value_sha256=None if value is None else hashlib.sha256(value).hexdigest(),
        headers=headers,
        headers_truncated=headers_cut,
        error_type=reason,
        error_message=message[:MESSAGE_CHARS_KEPT],
        attempts=attempts,
        raw_model_output=None if raw_model_output is None else raw_model_output[:MODEL_OUTPUT_CHARS_KEPT],
        trace_id=trace_id,
        created_at=datetime.now(UTC),
    )
    if value is None:
        return letter
    # What the rest takes, then as much of the value as fits (4 base64 characters per 3 bytes).
    room = max_message_bytes - RECORD_OVERHEAD_BYTES - len(letter.model_dump_json().encode())
    fits = max(0, room) // 4 * 3
    kept = value if len(value) <= min(max_value_bytes, fits) else value[: min(max_value_bytes, fits)]
    return letter.model_copy(update={"value_b64": _b64(kept), "value_truncated": kept is not value})


def encode_document(event: DocumentEvent) -> tuple[bytes, list[tuple[str, bytes]]]:
    """Value and headers for publishing a document."""
    return event.model_dump_json(exclude_none=True).encode("utf-8"), [("content-type", b"application/json")]
