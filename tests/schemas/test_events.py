from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from schemas import (
    CATEGORY_LABELS,
    URGENCY_CRITERIA,
    Analysis,
    Category,
    DocumentEvent,
    DocumentKind,
    Language,
    Triage,
    Urgency,
    analysis_json_schema,
    event_id_for,
    narrative_json_schema,
)
from schemas.events import ANSWER_BOUNDS, ANSWER_MAX_ITEMS
from schemas.export import EXPORTED, JSON_DIR, render


@pytest.mark.parametrize("name", sorted(EXPORTED))
def test_exported_json_schema_matches_the_models(name: str) -> None:
    exported = (JSON_DIR / f"{name}.schema.json").read_text(encoding="utf-8")
    assert exported == render(EXPORTED[name]), "stale: run `make schemas`"


def test_event_id_is_deterministic_and_distinct_per_coordinates() -> None:
    assert event_id_for("docs.complaints", 0, 7, 1, b"x") == event_id_for("docs.complaints", 0, 7, 1, b"x")
    ids = {event_id_for(t, p, o, 1, b"x") for t in ("a", "b") for p in (0, 1) for o in (0, 1, 10)}
    assert len(ids) == 12


def test_event_id_differs_for_another_record_at_the_same_coordinates() -> None:
    """Offsets restart at 0 on a re-created topic: the record there now (another time, other
    bytes) must not take the id, and so the answer, of the one that was there before."""
    alice = event_id_for("docs.complaints", 0, 0, 1_796_000_000_000, b"Alice's card 4111...")
    assert alice != event_id_for("docs.complaints", 0, 0, 1_796_000_000_000, b"Bob's complaint")
    assert alice != event_id_for("docs.complaints", 0, 0, 1_796_000_999_999, b"Alice's card 4111...")
    assert event_id_for("t", 0, 0, None, None) != event_id_for("t", 0, 0, None, b"")


def test_document_event_rejects_blank_text_and_unknown_fields() -> None:
    with pytest.raises(ValidationError):
        DocumentEvent(text="   ")
    with pytest.raises(ValidationError):
        DocumentEvent.model_validate({"text": "x", "surprise": 1})
    assert DocumentEvent(text=" hi ").text == "hi"


def test_analysis_schema_requires_triage_for_complaints_only() -> None:
    complaint = analysis_json_schema(DocumentKind.COMPLAINT)
    filing = analysis_json_schema(DocumentKind.FILING)
    assert "triage" in complaint["required"]
    assert "triage" not in filing["properties"]
    assert "Triage" not in filing["$defs"]
    json.dumps(complaint)  # plain data, ready for the engine


def test_analysis_bounds_its_lists() -> None:
    base = {
        "core_viewpoint": "x",
        "key_information": {"facts": ["f"] * 9, "data": [], "conclusions": []},
        "sentiment": {
            "polarity": "neutral",
            "implies_doubt": False,
            "implies_expectation": False,
            "rationale": "r",
        },
    }
    with pytest.raises(ValidationError):
        Analysis.model_validate(base)


@pytest.mark.parametrize("language", list(Language))
def test_answer_schema_bounds_every_string_and_list(language: Language) -> None:
    schema = analysis_json_schema(DocumentKind.COMPLAINT, language)
    key_info = schema["$defs"]["KeyInformation"]["properties"]
    assert all(key_info[n]["maxItems"] == ANSWER_MAX_ITEMS for n in ("facts", "data", "conclusions"))
    assert all("maxLength" in key_info[n]["items"] for n in ("facts", "data", "conclusions"))
    assert schema["properties"]["core_viewpoint"]["maxLength"] == ANSWER_BOUNDS[language].viewpoint
    assert (
        schema["$defs"]["Sentiment"]["properties"]["rationale"]["maxLength"]
        == ANSWER_BOUNDS[language].rationale
    )
    assert all(key_info[n]["items"]["maxLength"] == ANSWER_BOUNDS[language].item for n in key_info)


@pytest.mark.parametrize("language", list(Language))
def test_narrative_schema_is_what_the_model_writes_bounded(language: Language) -> None:
    schema = narrative_json_schema(language)
    assert set(schema["properties"]) == {"core_viewpoint", "key_information", "rationale"}
    assert schema["properties"]["core_viewpoint"]["maxLength"] == ANSWER_BOUNDS[language].viewpoint
    assert schema["properties"]["rationale"]["maxLength"] == ANSWER_BOUNDS[language].rationale
    key_info = schema["$defs"]["KeyInformation"]["properties"]
    assert all(key_info[n]["maxItems"] == ANSWER_MAX_ITEMS for n in ("facts", "data", "conclusions"))


@pytest.mark.parametrize("language", list(Language))
def test_the_decoder_cannot_write_a_one_word_viewpoint_or_rationale(language: Language) -> None:
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    grammar = Grammar.from_json_schema(json.dumps(narrative_json_schema(language)))
    bounds = ANSWER_BOUNDS[language]
    sentence = ("作者认为热水器漏电危及家人安全，要求全额退款。" if language is Language.ZH
                else "The writer holds that the heater is unsafe and asks for a full refund.")  # fmt: skip
    word = "负面" if language is Language.ZH else "Negative"
    assert len(sentence) >= max(bounds.viewpoint_min, bounds.rationale_min) > len(word)

    def answer(viewpoint: str, rationale: str) -> str:
        layers = {"facts": [sentence], "data": [], "conclusions": []}
        value = {"core_viewpoint": viewpoint, "key_information": layers, "rationale": rationale}
        return json.dumps(value, ensure_ascii=False)

    assert accepts(grammar, answer(sentence, sentence))
    assert not accepts(grammar, answer(word, sentence))
    assert not accepts(grammar, answer(sentence, word))


def test_triage_category_is_the_closed_taxonomy_in_the_schema_and_its_export() -> None:
    codes = [c.value for c in Category]
    assert "other" in codes and len(codes) == len(set(codes))
    assert set(CATEGORY_LABELS) == set(Category)
    assert all(label.zh and label.en and label.scope and label.scope_zh for label in CATEGORY_LABELS.values())
    assert len({label.zh for label in CATEGORY_LABELS.values()}) == len(codes)  # one display label each
    assert set(URGENCY_CRITERIA) == {u.value for u in Urgency}
    exported = json.loads((JSON_DIR / "analysis_event.schema.json").read_text(encoding="utf-8"))
    assert exported["$defs"]["Category"]["enum"] == codes
    assert exported["$defs"]["Triage"]["properties"]["category"] == {
        "$ref": "#/$defs/Category",
        "description": Triage.model_fields["category"].description,
    }
    with pytest.raises(ValidationError):
        Triage.model_validate({"urgency": "low", "category": "物流延误", "escalate": False})
