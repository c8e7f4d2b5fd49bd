"""Reads the model's answer into a validated `Analysis`, or says precisely why it cannot.

Tolerant of what small models wrap around JSON (code fences, a sentence before or after), strict
about the shape itself: the result always validates against `schemas.Analysis`.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from schemas import Analysis, DocumentKind


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


def parse_analysis(raw: str, kind: DocumentKind) -> Analysis:
    value = _normalise(_first_json_object(raw))
    if not isinstance(value, dict):
        raise AnalysisParseError("the JSON value is not an object", raw)
    if kind is not DocumentKind.COMPLAINT:
        value.pop("triage", None)
    try:
        analysis = Analysis.model_validate(value)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}" for err in exc.errors()
        )
        raise AnalysisParseError(f"schema violation: {problems}", raw) from exc
    if kind is DocumentKind.COMPLAINT and analysis.triage is None:
        raise AnalysisParseError("schema violation: triage: required for complaints", raw)
    return analysis
