"""Reads the model's answer into a validated `Analysis`, or says precisely why it cannot.

Tolerant of what small models wrap around JSON (code fences, a sentence before or after), strict
about the shape itself: the result always validates against `schemas.Analysis`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from prompts.hygiene import (
    copied_example,
    foreign_words,
    is_label_viewpoint,
    reached_bound,
    sort_layers,
    trim_cut,
    without_attitude_lead,
)
from prompts.render import worked_examples
from schemas import ANSWER_BOUNDS, Analysis, AnswerField, DocumentKind, Language, Narrative
from schemas.events import ANSWER_MAX_ITEMS


class AnalysisParseError(ValueError):
    """The model output is not a valid analysis; `raw` is the output as generated."""

    def __init__(self, message: str, raw: str) -> None:
        super().__init__(message)
        self.raw = raw


def _first_json_object(raw: str) -> Any:
    start = raw.find("{")
    if start < 0:
        raise AnalysisParseError("no JSON object in the output", raw)
    try:
        value, _ = json.JSONDecoder().raw_decode(raw, start)
    except json.JSONDecodeError as exc:
        raise AnalysisParseError(f"malformed JSON: {exc.msg} at character {exc.pos}", raw) from exc
    return value


def _normalise(value: Any) -> Any:
    # Small models write "Negative" or "HIGH"; the enum values are lower case.
    if isinstance(value, dict):
        sentiment = value.get("sentiment")
        if isinstance(sentiment, dict) and isinstance(sentiment.get("polarity"), str):
            sentiment["polarity"] = sentiment["polarity"].strip().lower()
        triage = value.get("triage")
        if isinstance(triage, dict) and isinstance(triage.get("urgency"), str):
            triage["urgency"] = triage["urgency"].strip().lower()
        # The grammar's minLength counts a lone space as a character, the schema (which strips
        # whitespace) does not: a blank list item says nothing and is dropped, not refused.
        layers = value.get("key_information")
        if isinstance(layers, dict):
            for name, items in layers.items():
                if isinstance(items, list):
                    layers[name] = [i for i in items if not (isinstance(i, str) and not i.strip())]
    return value


def _problems(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}" for err in exc.errors()
    )


def parse_analysis(raw: str, kind: str) -> Analysis:
    value = _normalise(_first_json_object(raw))
    if not isinstance(value, dict):
        raise AnalysisParseError("the JSON value is not an object", raw)
    if kind != DocumentKind.COMPLAINT:
        value.pop("triage", None)
    try:
        analysis = Analysis.model_validate(value)
    except ValidationError as exc:
        raise AnalysisParseError(f"schema violation: {_problems(exc)}", raw) from exc
    if kind == DocumentKind.COMPLAINT and analysis.triage is None:
        raise AnalysisParseError("schema violation: triage: required for complaints", raw)
    return analysis


def _own_fields(
    answers: Any, fields: Mapping[str, AnswerField], language: Language
) -> tuple[dict[str, Any], list[str]]:
    """The answers to a kind's own fields, texts trimmed like the report's items, and what is
    wrong with them (missing, of another type). Fields the kind does not have are dropped."""
    if not fields:
        return {}, []
    if not isinstance(answers, dict):
        return {}, [f"fields: an object with {', '.join(fields)} is required"]
    bound = ANSWER_BOUNDS[language].item
    kept: dict[str, Any] = {}
    problems = []
    for name, field in fields.items():
        answer = answers.get(name)
        if field.type == "boolean" and isinstance(answer, bool):
            kept[name] = answer
        elif field.type == "text" and isinstance(answer, str) and answer.strip():
            kept[name] = trim_cut(answer.strip(), bound, language)
        elif field.type == "list" and isinstance(answer, list):
            items = [trim_cut(i.strip(), bound, language) for i in answer if isinstance(i, str) and i.strip()]
            kept[name] = items[:ANSWER_MAX_ITEMS]
        else:
            problems.append(
                f"fields.{name}: {'missing' if answer is None else 'must be'} {_TYPES[field.type]}"
            )
    return kept, problems


_TYPES = {
    "text": "a non-empty text",
    "list": "a list of texts",
    "boolean": "true or false",
}  # what each must be


def parse_narrative(
    raw: str, language: Language, document: str, fields: Mapping[str, AnswerField] | None = None
) -> Narrative:
    """The model's narrative, cleaned by the hygiene rules (`prompts.hygiene`): fields that ran
    into their bound trimmed to a word boundary (list items with none to trim to dropped); filler,
    repeated and foreign-language items dropped, and so are items copied from the prompt's worked
    examples; data without a figure moved to facts. Refused (for the repair attempt) when the
    viewpoint or the rationale is a label, mixes languages, copies a worked example or runs into
    its bound with no boundary to trim back to, which no trimming can fix, or when an answer to
    one of the kind's own `fields` is missing or of the wrong type."""
    value = _first_json_object(raw)
    if not isinstance(value, dict):
        raise AnalysisParseError("the JSON value is not an object", raw)
    bounds = ANSWER_BOUNDS[language]
    examples = worked_examples(language)
    layers = value.get("key_information")
    if isinstance(layers, dict) and all(
        isinstance(layers.get(n), list) for n in ("facts", "data", "conclusions")
    ):
        cleaned: dict[str, list[str]] = {}
        for name in ("facts", "data", "conclusions"):
            items = [i for i in layers[name] if isinstance(i, str)]
            items = [trim_cut(i.strip(), bounds.item, language) for i in items]
            cleaned[name] = [
                i for i in items if not foreign_words(i, language, document)
                and not copied_example(i, examples, document)
                and not reached_bound(i, bounds.item, language)  # no boundary to trim back to: a run-on
            ]  # fmt: skip
        facts, data, conclusions = sort_layers(cleaned["facts"], cleaned["data"], cleaned["conclusions"])
        value["key_information"] = {"facts": facts, "data": data, "conclusions": conclusions}
    problems = []
    for name, bound in (("core_viewpoint", bounds.viewpoint), ("rationale", bounds.rationale)):
        text = value.get(name)
        if not isinstance(text, str):
            continue
        text = trim_cut(text.strip(), bound, language)
        value[name] = text = without_attitude_lead(text) if name == "core_viewpoint" else text
        if words := foreign_words(text, language, document):
            problems.append(f"{name}: write it in one language (found {', '.join(words[:3])})")
        if reached_bound(text, bound, language):
            problems.append(f"{name}: one shorter sentence (it ran into its bound of {bound} characters)")
        if copied := copied_example(text, examples, document):
            problems.append(f'{name}: about this document, not the examples (copied "{copied}")')
    value["fields"], wrong = _own_fields(value.get("fields"), fields or {}, language)
    problems += wrong
    viewpoint = value.get("core_viewpoint")
    if isinstance(viewpoint, str) and viewpoint.strip() and is_label_viewpoint(viewpoint, language):
        problems.append("core_viewpoint: state the writer's position in a full sentence, not a label")
    if problems:
        raise AnalysisParseError("; ".join(problems), raw)
    try:
        return Narrative.model_validate(value)
    except ValidationError as exc:
        raise AnalysisParseError(f"schema violation: {_problems(exc)}", raw) from exc
