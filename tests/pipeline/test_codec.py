from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.codec import MAX_DOCUMENT_ID_CHARS, RawRecord, RecordError, dead_letter, decode_document
from schemas import DeadLetter, DeadLetterReason, DocumentKind, Language


def record(value: bytes | None, key: bytes | None = None, headers: Any = ()) -> RawRecord:
    return RawRecord("docs.filings", 1, 42, 1_796_000_000_000, key, value, tuple(headers))


def decode(value: bytes | None, key: bytes | None = None, headers: Any = (), max_chars: int = 100) -> Any:
    return decode_document(record(value, key, headers), default_kind=DocumentKind.FILING, max_chars=max_chars)


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
        # Found by an attacker: these raised RecursionError / ValueError out of the codec, the
        # record's task died unanswered and its partition's commits stopped for good.
        (b'{"text": "x", "metadata": ' + b"[" * 1000 + b"]" * 1000 + b"}", [], DeadLetterReason.INVALID_JSON),
        (b'{"text": "x", "metadata": {"n": ' + b"9" * 5000 + b"}}", [], DeadLetterReason.INVALID_JSON),
        (b"[" * 100_000, [("content-type", b"application/json")], DeadLetterReason.INVALID_JSON),
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
        record(b"\xff\x00raw", b"k", [("h", b"\x01")]), reason=DeadLetterReason.NOT_UTF8, message="bad"
    )
    assert letter.value_b64 is not None and base64.b64decode(letter.value_b64) == b"\xff\x00raw"
    assert (
        letter.headers[0].value_b64 is not None and base64.b64decode(letter.headers[0].value_b64) == b"\x01"
    )
    assert letter.source.offset == 42 and letter.attempts == 0


def test_a_key_too_long_for_an_id_names_the_document_by_its_hash() -> None:
    """An 800 KB key used to become the document id and the answer's key, unbounded."""
    key = b"k" * 800_000
    document = decode(b"Revenue grew.", key=key)
    assert document.document_id == "key-sha256:" + hashlib.sha256(key).hexdigest()
    assert len(document.document_id) <= MAX_DOCUMENT_ID_CHARS
    assert (
        decode(b"Revenue grew.", key=b"r" * MAX_DOCUMENT_ID_CHARS).document_id == "r" * MAX_DOCUMENT_ID_CHARS
    )


def _carried(letter: DeadLetter, value: bytes | None, key: bytes | None) -> None:
    """What a dead letter says of the original matches it: lengths, hashes, and carried prefixes."""
    if value is not None:
        kept = base64.b64decode(letter.value_b64 or "")
        assert letter.value_bytes == len(value) and letter.value_sha256 == hashlib.sha256(value).hexdigest()
        assert value.startswith(kept) and (letter.value_truncated or kept == value)
    if key is not None:
        kept_key = base64.b64decode(letter.key_b64 or "")
        assert letter.key_bytes == len(key) and letter.key_sha256 == hashlib.sha256(key).hexdigest()
        assert key.startswith(kept_key) and (letter.key_truncated or kept_key == key)


def test_a_dead_letter_fits_the_message_limit_whatever_the_key_and_headers() -> None:
    """The crash loop: an 800 KB key and large headers made a 1 MB+ dead letter that the broker
    refused on every restart. Now key, headers and value share the limit, and the value gives way."""
    key, value = b"\x00" * 800_000, bytes(range(256)) * 4000
    headers = [(f"h{i}" * 100, b"\xff" * 10_000) for i in range(200)]
    letter = dead_letter(
        record(value, key, headers),
        reason=DeadLetterReason.NOT_UTF8,
        message="m" * 100_000,
        raw_model_output="o" * 1_000_000,
        max_value_bytes=64 * 1024 * 1024,
        max_message_bytes=1_000_000,
    )
    assert len(letter.model_dump_json().encode()) <= 1_000_000
    assert letter.key_truncated and letter.value_truncated and letter.headers_truncated
    _carried(letter, value, key)


@settings(max_examples=60, deadline=None)
@given(
    value=st.none() | st.binary(max_size=5_000),
    key=st.none() | st.binary(max_size=3_000),
    headers=st.lists(st.tuples(st.text(max_size=300), st.none() | st.binary(max_size=6_000)), max_size=80),
    limit=st.integers(min_value=64 * 1024, max_value=256 * 1024),
)
def test_any_record_has_a_dead_letter_within_the_limit(
    value: bytes | None, key: bytes | None, headers: list[tuple[str, bytes | None]], limit: int
) -> None:
    letter = dead_letter(
        record(value, key, headers),
        reason=DeadLetterReason.INTERNAL_ERROR,
        message="x",
        max_message_bytes=limit,
    )
    assert len(letter.model_dump_json().encode()) <= limit
    _carried(letter, value, key)
    assert DeadLetter.model_validate_json(letter.model_dump_json()) == letter
