"""Kinds as configuration: a kinds file adds a kind (topic, prompts, answer fields) without code,
is checked at start with every problem named, and the built-in kinds stay what they were."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from pipeline.client import collect_answers, publish_documents, publish_raw
from pipeline.kafka import ensure_topics
from pipeline.kinds import read_kinds
from pipeline.service import Service, running
from pipeline.settings import Settings, SettingsError, load_settings
from pipeline.telemetry import Telemetry
from prompts import AnalysisParseError, parse_narrative, render
from schemas import (
    AnalysisEvent,
    DeadLetter,
    DeadLetterReason,
    DocumentEvent,
    Language,
    narrative_json_schema,
)
from schemas.kinds import built_in_kinds
from tests.pipeline.fakes import ScriptedEngine

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "kinds.example.toml"
TICKET = """
[kinds.support_ticket]
topic = "{topic}"
title = {{ zh = "技术支持工单", en = "support ticket" }}

[kinds.support_ticket.fields.product]
description = {{ zh = "工单涉及的产品", en = "the product the ticket is about" }}

[kinds.support_ticket.fields.data_loss]
description = {{ zh = "是否丢失数据", en = "whether data was lost" }}
type = "boolean"
"""


def kinds_of(text: str, tmp_path: Path) -> dict[str, object]:
    path = tmp_path / "kinds.toml"
    path.write_text(text, encoding="utf-8")
    built_in = built_in_kinds("docs.complaints", "docs.meeting-notes", "docs.filings")
    return dict(read_kinds(path, built_in, ("analysis.events", "analysis.dlq")))


def test_the_documented_example_loads_beside_the_built_in_kinds() -> None:
    built_in = built_in_kinds("docs.complaints", "docs.meeting-notes", "docs.filings")
    kinds = read_kinds(EXAMPLE, built_in, ("analysis.events", "analysis.dlq"))
    assert list(kinds) == ["complaint", "meeting_notes", "filing", "support_ticket"]
    ticket = kinds["support_ticket"]
    assert ticket.topic == "docs.support-tickets" and not ticket.triage
    assert {n: f.type for n, f in ticket.fields.items()} == {
        "product": "text",
        "steps_tried": "list",
        "data_loss": "boolean",
    }
    assert read_kinds(None, built_in, ()) == built_in  # no file: the three built in


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[kinds.complaint]\ntitle = { zh = 'a', en = 'b' }", "kinds.complaint: built in"),
        ("[kinds.x]\ntitle = { zh = 'a', en = 'b' }\n[kinds.x.fields.f]\n"
         "description = { zh = 'a', en = 'b' }\ntype = 'number'", "kinds.x.fields.f.type"),
        ("[kinds.x]\ntitle = { zh = 'a' }", "kinds.x.title.en: Field required"),
        ("[kinds.x]\ntitle = { zh = 'a', en = 'b' }\ncolour = 'red'", "kinds.x.colour: Extra inputs"),
        ("[kinds.x]\ntitle = { zh = 'a', en = 'b' }\ntopic = 'docs.complaints'", "also complaint's"),
        ("[kinds.x]\ntitle = { zh = 'a', en = 'b' }\ntopic = 'analysis.events'", "where answers are written"),
        ("[kinds.x]\ntitle = { zh = 'a', en = 'b' }\nnarrative = { zh = '$kind', en = 'b' }", "$kind_name"),
        ("[kinds.Bad-Name]\ntitle = { zh = 'a', en = 'b' }", "kinds.Bad-Name.name"),
        ("[kinds.x\ntitle = 1", "not valid TOML"),
        ("[other]\nx = 1", "only a [kinds] table"),
    ],
)  # fmt: skip
def test_each_problem_of_a_kinds_file_is_named(text: str, expected: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="KINDS_FILE=") as raised:
        kinds_of(text, tmp_path)
    assert expected in str(raised.value)


def test_a_bad_kinds_file_stops_the_worker_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KINDS_FILE", str(tmp_path / "missing.toml"))
    with pytest.raises(SettingsError, match=r"KINDS_FILE=.*cannot be read"):
        load_settings()


def test_a_kind_s_fields_are_asked_for_required_by_its_schema_and_parsed(tmp_path: Path) -> None:
    ticket = kinds_of(TICKET.format(topic="docs.tickets"), tmp_path)["support_ticket"]
    prompt = render(ticket, Language.EN, "The sync app deleted my files.").messages[-1]["content"]  # type: ignore[arg-type]
    assert "support ticket" in prompt and '"product": the product the ticket is about' in prompt
    assert '"fields": {"product": "...", "data_loss": false}' in prompt
    schema = narrative_json_schema(Language.EN, ticket.fields)  # type: ignore[attr-defined]
    assert (
        schema["properties"]["fields"]["required"] == ["product", "data_loss"]
        and "fields" in schema["required"]
    )
    assert schema["properties"]["fields"]["properties"]["data_loss"] == {"type": "boolean"}
    assert "fields" not in narrative_json_schema(Language.EN)["properties"]  # built-in kinds: none
    answer = {
        "core_viewpoint": "The writer holds that the sync app deleted their files and wants them back.",
        "key_information": {"facts": ["The sync app deleted files."], "data": [], "conclusions": []},
        "rationale": "Files were lost.",
        "fields": {"product": "  SyncApp  ", "data_loss": True, "unasked": "dropped"},
    }
    narrative = parse_narrative(
        json.dumps(answer), Language.EN, "The sync app deleted my files.", ticket.fields
    )  # type: ignore[attr-defined]
    assert narrative.fields == {"product": "SyncApp", "data_loss": True}
    del answer["fields"]["data_loss"]  # type: ignore[attr-defined]
    with pytest.raises(AnalysisParseError, match=r"fields\.data_loss: missing"):
        parse_narrative(json.dumps(answer), Language.EN, "x", ticket.fields)  # type: ignore[attr-defined]


@pytest.mark.integration
async def test_a_kind_added_by_file_alone_is_consumed_analysed_and_answered(
    settings: Settings, telemetry: Telemetry, tmp_path: Path
) -> None:
    topic = settings.topic_complaints.replace("complaints", "tickets")
    path = tmp_path / "kinds.toml"
    path.write_text(TICKET.format(topic=topic), encoding="utf-8")
    settings = Settings(**{**settings.model_dump(), "kinds_file": path})
    assert settings.input_topics[topic] == "support_ticket"
    await ensure_topics(settings)
    # Plain text on the kind's topic takes its kind; JSON names it anywhere; an unknown kind is refused.
    plain = await publish_raw(
        settings, topic, b"My SyncApp deleted every file in the shared folder.", key=b"t-1"
    )
    named, unknown = await publish_documents(
        settings,
        [
            DocumentEvent(document_id="t-2", kind="support_ticket", text="Backups fail since the update."),
            DocumentEvent(document_id="t-3", kind="invoice", text="Invoice 17 is overdue."),
        ],
        topic=settings.topic_complaints,
    )
    service = Service(settings, ScriptedEngine(), telemetry)
    async with running(service, asyncio.Event()):
        answers = await collect_answers(
            settings, {plain.event_id, named.event_id, unknown.event_id}, timeout_s=60
        )
    for sent in (plain, named):
        event = answers[sent.event_id][0]
        assert isinstance(event, AnalysisEvent), event
        assert event.kind == "support_ticket" and event.analysis.triage is None
        assert (
            set(event.analysis.fields) == {"product", "data_loss"}
            and event.analysis.fields["data_loss"] is True
        )
        AnalysisEvent.model_validate_json(event.model_dump_json())
    refused = answers[unknown.event_id][0]
    assert isinstance(refused, DeadLetter) and refused.error_type is DeadLetterReason.SCHEMA_VIOLATION
    assert "'invoice' is not one this worker knows" in refused.error_message
