"""Answers are keyed so that they land beside what they answer."""

from __future__ import annotations

import base64
from datetime import UTC, datetime

import pytest

from pipeline.kafka import make_answer_producer, make_producer
from pipeline.publish import answer_record
from pipeline.settings import Settings
from schemas import DeadLetter, DeadLetterReason, SourceCoordinates


def dead_letter(document_id: str | None, key: bytes | None, truncated: bool = False) -> DeadLetter:
    return DeadLetter(
        event_id="e-1", document_id=document_id, source=SourceCoordinates(topic="t", partition=0, offset=7),
        key_b64=None if key is None else base64.b64encode(key).decode(), key_truncated=truncated,
        value_b64=None, headers=[], error_type=DeadLetterReason.INVALID_JSON, error_message="x", attempts=1,
        created_at=datetime.now(UTC),
    )  # fmt: skip


def test_a_dead_letter_of_an_unreadable_record_keeps_the_records_own_key_in_any_bytes() -> None:
    settings = Settings()
    topic, key, _ = answer_record(dead_letter(None, b"\xffcrm-42"), settings)
    assert topic == settings.topic_dead_letters and key == b"\xffcrm-42"


def test_a_dead_letter_is_keyed_by_its_document_id_else_by_its_event_id() -> None:
    settings = Settings()
    assert answer_record(dead_letter("doc-9", b"crm-42"), settings)[1] == b"doc-9"
    assert answer_record(dead_letter(None, None), settings)[1] == b"e-1"
    assert answer_record(dead_letter(None, b"a-long-key", truncated=True), settings)[1] == b"e-1"  # not whole


@pytest.mark.parametrize("idempotent", [True, False])
async def test_the_answers_producer_is_idempotent_as_set_and_a_documents_producer_never(
    idempotent: bool,
) -> None:
    settings = Settings(kafka_enable_idempotence=idempotent)
    answers, documents = make_answer_producer(settings), make_producer(settings)
    try:  # aiokafka keeps a transaction manager (producer id, sequence numbers) exactly when idempotent
        assert (answers._txn_manager is not None) is idempotent
        assert documents._txn_manager is None
    finally:
        await answers.stop()
        await documents.stop()
