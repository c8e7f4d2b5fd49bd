"""The CLI: errors are sentences, not tracebacks; publish and tail do what kcat users expect."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiokafka.structs import ConsumerRecord, TopicPartition

from pipeline.client import publish_raw
from pipeline.kafka import ensure_topics, make_consumer, partitions_of
from pipeline.settings import Settings
from schemas import DeadLetter, DeadLetterReason, DocumentEvent, SourceCoordinates


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_invalid_setting_names_the_variable() -> None:
    result = run_cli("run", MAX_BATCH_SIZE="-3")
    assert result.returncode == 2
    assert "MAX_BATCH_SIZE" in result.stderr and "Traceback" not in result.stderr


def test_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    result = run_cli("run", MODEL_PATH=str(tmp_path / "missing"), KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1")
    assert result.returncode == 3
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_model_path_that_is_not_a_model(tmp_path: Path) -> None:
    result = run_cli("run", MODEL_PATH=str(tmp_path), KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1")
    assert result.returncode == 3
    assert "config.json is missing" in result.stderr


def test_help_and_version_answer_without_loading_torch_or_the_kafka_client() -> None:
    """`--help` and `--version` are for a person at a prompt: they must not wait for torch."""
    probe = (
        "import sys\nfrom pipeline.cli import main\n"
        "for args in (['--version'], ['--help'], ['tail', '--help']):\n"
        "    try:\n        main(args)\n    except SystemExit:\n        pass\n"
        "print('loaded:', sorted(m for m in ('torch', 'aiokafka', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert "deepanalyze 0.1.0" in result.stdout
    assert "loaded: []" in result.stdout, result.stdout


def test_plain_text_without_a_kind_or_a_topic_is_refused_before_anything_is_sent(tmp_path: Path) -> None:
    (tmp_path / "note.txt").write_text("The meeting moved to Friday.", encoding="utf-8")
    result = run_cli("publish", str(tmp_path), KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1")  # no broker there
    assert result.returncode == 2
    assert "plain text has no kind (note)" in result.stderr and "--kind" in result.stderr
    assert "Traceback" not in result.stderr and "Kafka error" not in result.stderr


def test_an_unknown_kind_is_refused_naming_the_kinds_there_are(tmp_path: Path) -> None:
    kinds = tmp_path / "kinds.toml"
    kinds.write_text(
        "[kinds.support_ticket]\ntitle = { zh = '工单', en = 'support ticket' }\n", encoding="utf-8"
    )
    (tmp_path / "note.txt").write_text("The app crashes.", encoding="utf-8")
    result = run_cli("publish", str(tmp_path / "note.txt"), "--kind", "ticket", KINDS_FILE=str(kinds),
                     KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1")  # fmt: skip
    assert result.returncode == 2 and "unknown kind 'ticket'" in result.stderr
    assert "support_ticket" in result.stderr and "Traceback" not in result.stderr


def test_empty_stdin_is_a_sentence(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "publish", "-", "--kind", "complaint"],
        env={**os.environ, "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"},
        input="  \n", capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "standard input was empty" in result.stderr and "Traceback" not in result.stderr


def test_a_bad_header_is_named() -> None:
    result = run_cli("publish", "-", "--kind", "complaint", "--header", "no-equals-sign")
    assert result.returncode == 2 and "NAME=VALUE" in result.stderr


def cli_env(settings: Settings) -> dict[str, str]:
    return {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": settings.kafka_bootstrap_servers,
        "TOPIC_COMPLAINTS": settings.topic_complaints,
        "TOPIC_MEETING_NOTES": settings.topic_meeting_notes,
        "TOPIC_FILINGS": settings.topic_filings,
        "TOPIC_ANALYSIS": settings.topic_analysis,
        "TOPIC_DEAD_LETTERS": settings.topic_dead_letters,
    }


async def read_topic(settings: Settings, topic: str, expected: int) -> list[ConsumerRecord[bytes, bytes]]:
    consumer = make_consumer(settings, grouped=False)
    await consumer.start()
    try:
        found = await partitions_of(settings, [topic])
        partitions = [TopicPartition(topic, p) for p in found[topic]]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        records: list[ConsumerRecord[bytes, bytes]] = []
        deadline = time.monotonic() + 30
        while len(records) < expected and time.monotonic() < deadline:
            for batch in (await consumer.getmany(timeout_ms=500)).values():
                records += batch
        return records
    finally:
        await consumer.stop()


@pytest.mark.integration
async def test_publish_lines_sends_one_record_per_line_with_the_key_headers_and_topic_given(
    settings: Settings,
) -> None:
    await ensure_topics(settings)
    lines = 'first complaint\n\n{"document_id": "j1", "kind": "filing", "text": "a filing"}\nthird\n'
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pipeline", "publish", "-", "--lines", "--topic", settings.topic_complaints,
        "--key", "k1", "--header", "source=crm", env=cli_env(settings),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(lines.encode()), 120)
    assert proc.returncode == 0, err.decode()
    assert len(out.decode().splitlines()) == 3  # the blank line is no document
    records = await read_topic(settings, settings.topic_complaints, 3)
    documents = [DocumentEvent.model_validate_json(r.value) for r in records if r.value]
    assert sorted(d.text for d in documents) == ["a filing", "first complaint", "third"]  # the filing too
    assert all(r.key == b"k1" and ("source", b"crm") in list(r.headers) for r in records)


def dead_letter(n: int) -> bytes:
    return DeadLetter(
        event_id=f"dl-{n}", source=SourceCoordinates(topic="t", partition=0, offset=n), key_b64=None,
        value_b64=None, headers=[], error_type=DeadLetterReason.INVALID_JSON, error_message="x",
        attempts=1, created_at=datetime.now(UTC),
    ).model_dump_json().encode()  # fmt: skip


async def tail(settings: Settings, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pipeline", "tail", "--json", *args, env=cli_env(settings),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


@pytest.mark.integration
async def test_tail_follows_from_now_stops_at_exactly_count_and_prints_one_json_object_per_line(
    settings: Settings,
) -> None:
    await ensure_topics(settings)
    for n in range(3):
        await publish_raw(settings, settings.topic_dead_letters, dead_letter(n))
    following = await tail(settings, "--count", "2")
    assert following.stderr is not None
    ready = b""
    while not ready.startswith(b"%"):  # the notice, after any log lines
        ready = await asyncio.wait_for(following.stderr.readline(), 60)
    assert b"from now on" in ready
    for n in range(3, 6):
        await publish_raw(settings, settings.topic_dead_letters, dead_letter(n))
    out, _ = await asyncio.wait_for(following.communicate(), 60)
    printed = [json.loads(line)["event_id"] for line in out.decode().splitlines()]
    assert len(printed) == 2 and set(printed) <= {"dl-3", "dl-4", "dl-5"}  # exactly 2, none from before

    everything = await tail(settings, "--from-beginning", "--timeout", "5")
    out, _ = await asyncio.wait_for(everything.communicate(), 60)
    assert sorted(json.loads(line)["event_id"] for line in out.decode().splitlines()) == [
        f"dl-{n}" for n in range(6)
    ]
