from __future__ import annotations

import json

import pytest

from prompts import AnalysisParseError, parse_analysis
from schemas import DocumentKind, Polarity, Urgency

VALID = {
    "core_viewpoint": "The customer wants a refund.",
    "key_information": {"facts": ["late"], "data": ["$40"], "conclusions": ["refund"]},
    "sentiment": {
        "polarity": "Negative",
        "implies_doubt": True,
        "implies_expectation": True,
        "rationale": "angry",
    },
    "triage": {"urgency": "HIGH", "category": "billing", "escalate": True},
}


def test_parses_json_wrapped_in_fences_and_prose() -> None:
    raw = "Here you go:\n```json\n" + json.dumps(VALID) + "\n```\nAnything else?"
    analysis = parse_analysis(raw, DocumentKind.COMPLAINT)
    assert analysis.sentiment.polarity is Polarity.NEGATIVE
    assert analysis.triage is not None and analysis.triage.urgency is Urgency.HIGH


def test_triage_is_dropped_for_non_complaints() -> None:
    assert parse_analysis(json.dumps(VALID), DocumentKind.FILING).triage is None


def test_blank_items_are_dropped_and_a_blank_viewpoint_is_refused() -> None:
    """The constrained grammar lets a lone space through as a non-empty string (seen in the KV
    harness: a conclusion of " "); such an item carries nothing and must not cost the analysis."""
    value = json.loads(json.dumps(VALID))
    value["key_information"]["conclusions"] = ["refund", " ", "\n"]
    analysis = parse_analysis(json.dumps(value), DocumentKind.COMPLAINT)
    assert analysis.key_information.conclusions == ["refund"]
    with pytest.raises(AnalysisParseError, match="core_viewpoint"):
        parse_analysis(json.dumps(VALID | {"core_viewpoint": " "}), DocumentKind.COMPLAINT)


def test_complaint_without_triage_is_rejected() -> None:
    value = {k: v for k, v in VALID.items() if k != "triage"}
    with pytest.raises(AnalysisParseError, match="triage"):
        parse_analysis(json.dumps(value), DocumentKind.COMPLAINT)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("no json here", "no JSON object"),
        ('{"core_viewpoint": "unterminated', "malformed JSON"),
        ('{"core_viewpoint": "x"}', "schema violation"),
    ],
)
def test_invalid_outputs_say_why_and_keep_the_raw_text(raw: str, message: str) -> None:
    with pytest.raises(AnalysisParseError, match=message) as info:
        parse_analysis(raw, DocumentKind.MEETING_NOTES)
    assert info.value.raw == raw
