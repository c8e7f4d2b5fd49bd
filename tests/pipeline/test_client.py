"""The client's side of matching answers: the event id it expects is the one the worker gives."""

from __future__ import annotations

from aiokafka.structs import RecordMetadata, TopicPartition

from pipeline.client import LOG_APPEND_TIME, answer_id
from schemas import event_id_for

CREATE_TIME = 0
TP = TopicPartition("docs.complaints", 1)


def test_a_duplicate_batch_acknowledgement_names_the_record_the_worker_reads() -> None:
    """An idempotent producer resends a batch after a leader change; the new leader already has
    it and answers with the batch's largest CreateTime as a log-append time. The worker reads the
    record with its own CreateTime, so only a caller that knows the topic keeps CreateTime
    (`append_time=False`) expects the id the worker gives. The likely cause of the fault test's
    "lost" documents in CI (1 and 4, answered but looked for under another id)."""
    value, own_ms, batch_max_ms = b'{"text": "d60"}', 1_700_000_000_000, 1_700_000_000_007
    duplicate_ack = RecordMetadata(TP.topic, TP.partition, TP, 42, batch_max_ms, LOG_APPEND_TIME, 0)
    worker = event_id_for(TP.topic, TP.partition, 42, own_ms, value)  # what the consumer sees
    assert answer_id(duplicate_ack, value, own_ms, append_time=False) == worker
    assert answer_id(duplicate_ack, value, own_ms) != worker  # trusting the ack's type misses it


def test_the_acknowledgement_decides_when_the_topic_is_not_known() -> None:
    """The service's own producers are not idempotent (no duplicate-batch replies): a log-append
    time in their acknowledgement is the topic's, and the worker reads that time."""
    value, own_ms, broker_ms = b"x", 1_700_000_000_000, 1_700_000_000_500
    appended = RecordMetadata(TP.topic, TP.partition, TP, 7, broker_ms, LOG_APPEND_TIME, 0)
    created = RecordMetadata(TP.topic, TP.partition, TP, 7, -1, CREATE_TIME, 0)
    assert answer_id(appended, value, own_ms) == event_id_for(TP.topic, TP.partition, 7, broker_ms, value)
    assert answer_id(created, value, own_ms) == event_id_for(TP.topic, TP.partition, 7, own_ms, value)
    assert answer_id(appended, value, own_ms, append_time=True) == answer_id(appended, value, own_ms)
