from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from pipeline.codec import RecordError, dead_letter, decode_document
from schemas import DeadLetterReason, DocumentKind, Language


def decode(value: bytes | None, key: bytes | None = None, headers: Any = (), max_chars: int = 100) -> Any:
    return decode_document(
        topic="docs.filings",
        partition=1,
        offset=42,
        key=key,
        value=value,
        headers=list(headers),
        default_kind=DocumentKind.FILING,
        max_chars=max_chars,
    )


def test_plain_text_takes_kind_from_topic_and_id_from_key() -> None:
    document = decode("营收增长 12%".encode(), key=b"report-7")
    assert (document.document_id, document.kind, document.language) == (
        "report-7",
        DocumentKind.FILING,
        Language.ZH,
    )


def test_plain_text_without_key_is_named_by_coordinates() -> None:
    assert decode(b"Revenue grew.").document_id == "docs.filings/1/42"


def test_json_document_overrides_defaults() -> None:
    value = json.dumps({"document_id": "c-1", "kind": "complaint", "text": "late", "language": "en"}).encode()
    document = decode(value, key=b"ignored")
    assert (document.document_id, document.kind, document.language) == (
        "c-1",
        DocumentKind.COMPLAINT,
        Language.EN,
    )


def test_text_plain_header_keeps_braces_as_text() -> None:
    assert decode(b"{not json", headers=[("content-type", b"text/plain")]).text == "{not json"


@pytest.mark.parametrize(
    ("value", "headers", "reason"),
    [
        (b"\xff\xfe", [], DeadLetterReason.NOT_UTF8),
        (b"{broken", [], DeadLetterReason.INVALID_JSON),
        (
            b"[1, 2]",
            [("content-type", b"application/json; charset=utf-8")],
            DeadLetterReason.SCHEMA_VIOLATION,
        ),
        (b'{"text": "x", "kind": "poem"}', [], DeadLetterReason.SCHEMA_VIOLATION),
        (b'{"text": "  "}', [], DeadLetterReason.EMPTY_TEXT),
        (b"  ", [], DeadLetterReason.EMPTY_TEXT),
        (None, [], DeadLetterReason.EMPTY_TEXT),
        (b"x" * 101, [], DeadLetterReason.TOO_LONG),
    ],
)
def test_bad_records_are_refused_with_their_reason(
    value: bytes | None, headers: Any, reason: DeadLetterReason
) -> None:
    with pytest.raises(RecordError) as info:
        decode(value, headers=headers)
    assert info.value.reason is reason


def test_dead_letter_keeps_the_original_bytes() -> None:
    letter = dead_letter(
        topic="docs.filings",
        partition=1,
        offset=42,
        key=b"k",
        value=b"\xff\x00raw",
        headers=[("h", b"\x01")],
        reason=DeadLetterReason.NOT_UTF8,
        message="bad",
    )
    assert letter.value_b64 is not None and base64.b64decode(letter.value_b64) == b"\xff\x00raw"
    assert (
        letter.headers[0].value_b64 is not None and base64.b64decode(letter.headers[0].value_b64) == b"\x01"
    )
    assert letter.source.offset == 42 and letter.attempts == 0
