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
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from prompts import detect_language
from schemas import (
    DeadLetter,
    DeadLetterReason,
    DocumentEvent,
    DocumentKind,
    Header,
    Language,
    SourceCoordinates,
    event_id_for,
)

JSON_TYPES = ("application/json",)
TEXT_TYPES = ("text/plain",)


class RecordError(ValueError):
    """A record that cannot become a document; carries the dead-letter reason."""

    def __init__(self, reason: DeadLetterReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Document:
    """A validated document with its defaults resolved, and where it came from."""

    document_id: str
    kind: DocumentKind
    language: Language
    text: str
    source: SourceCoordinates
    source_system: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def event_id(self) -> str:
        return event_id_for(self.source.topic, self.source.partition, self.source.offset)


def _header(headers: Any, name: str) -> str | None:
    for key, value in headers or ():
        if key.lower() == name and value is not None:
            return bytes(value).decode("utf-8", errors="replace").split(";")[0].strip().lower()
    return None


def decode_document(
    *,
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    headers: Any,
    default_kind: DocumentKind,
    max_chars: int,
) -> Document:
    source = SourceCoordinates(topic=topic, partition=partition, offset=offset)
    if value is None:
        raise RecordError(DeadLetterReason.EMPTY_TEXT, "the record has no value")
    try:
        body = value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordError(
            DeadLetterReason.NOT_UTF8, f"the value is not UTF-8: {exc.reason} at byte {exc.start}"
        ) from exc
    content_type = _header(headers, "content-type")
    is_json = content_type in JSON_TYPES or (content_type not in TEXT_TYPES and body.lstrip().startswith("{"))
    event = _parse_json(body) if is_json else None
    text = event.text if event else body.strip()
    if not text:
        raise RecordError(DeadLetterReason.EMPTY_TEXT, "the document text is empty")
    if len(text) > max_chars:
        raise RecordError(
            DeadLetterReason.TOO_LONG, f"the document has {len(text)} characters; the limit is {max_chars}"
        )
    key_id = key.decode("utf-8", errors="replace").strip() if key else ""
    return Document(
        document_id=(event.document_id if event and event.document_id else None)
        or key_id
        or f"{topic}/{partition}/{offset}",
        kind=(event.kind if event and event.kind else None) or default_kind,
        language=(event.language if event and event.language else None) or detect_language(text),
        text=text,
        source=source,
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
    if isinstance(raw, dict) and isinstance(raw.get("text"), str) and not raw["text"].strip():
        raise RecordError(DeadLetterReason.EMPTY_TEXT, "the document text is empty")
    try:
        return DocumentEvent.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in exc.errors())
        raise RecordError(DeadLetterReason.SCHEMA_VIOLATION, f"not a DocumentEvent: {problems}") from exc


def _b64(data: bytes | None) -> str | None:
    return base64.b64encode(data).decode("ascii") if data is not None else None


def dead_letter(
    *,
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    headers: Any,
    reason: DeadLetterReason,
    message: str,
    attempts: int = 0,
    document_id: str | None = None,
    raw_model_output: str | None = None,
    trace_id: str | None = None,
    max_value_bytes: int = 512 * 1024,
) -> DeadLetter:
    """The dead letter for a record. Its value travels whole up to `max_value_bytes` (base64 adds
    a third: a dead letter must fit a topic's default 1 MB message limit); beyond that only its
    first bytes, its length and SHA-256, and the coordinates where the original still lies."""
    kept = value if value is None or len(value) <= max_value_bytes else value[:max_value_bytes]
    return DeadLetter(
        event_id=event_id_for(topic, partition, offset),
        document_id=document_id,
        source=SourceCoordinates(topic=topic, partition=partition, offset=offset),
        key_b64=_b64(key),
        value_b64=_b64(kept),
        value_bytes=None if value is None else len(value),
        value_sha256=None if value is None else hashlib.sha256(value).hexdigest(),
        value_truncated=kept is not value,
        headers=[
            Header(key=k, value_b64=_b64(bytes(v) if v is not None else None)) for k, v in headers or ()
        ],
        error_type=reason,
        error_message=message,
        attempts=attempts,
        raw_model_output=raw_model_output,
        trace_id=trace_id,
        created_at=datetime.now(UTC),
    )


def encode_document(event: DocumentEvent) -> tuple[bytes, list[tuple[str, bytes]]]:
    """Value and headers for publishing a document."""
    return event.model_dump_json(exclude_none=True).encode("utf-8"), [("content-type", b"application/json")]
