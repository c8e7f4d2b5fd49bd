"""Everything that travels on a topic: documents in, analysis events and dead letters out.

Owns the wire shapes and the deterministic event id. Knows nothing of Kafka clients, the engine
or prompts; other packages import from here, never the other way round.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from schemas.kinds import AnswerField, FieldName, KindName
from schemas.taxonomy import Category

# 1.2: `kind` is any configured kind's name (KINDS_FILE), no longer one of three; analyses carry
# `fields`, the answers to a kind's own fields.
SCHEMA_VERSION: Literal["1.2"] = "1.2"

# Fixed namespace so that a record always maps to the same event id, on every worker and across
# restarts: a re-delivered record yields the same id.
EVENT_ID_NAMESPACE = uuid.UUID("5b0f7c1e-4f2a-4d7e-9a51-0d5f3e6a2c11")

NonEmptyStr = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]
# Bounded so that a constrained decoder cannot loop inside one field or one list forever.
Item = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=300)]
MAX_ITEMS = 8
# An answer to a kind's own field (`schemas.kinds.AnswerField`): a text, a list of texts, yes/no.
FieldValue = Item | list[Item] | bool


class DocumentKind(StrEnum):
    """The built-in kinds; a worker may know more (`schemas.kinds`, KINDS_FILE)."""

    COMPLAINT = "complaint"
    MEETING_NOTES = "meeting_notes"
    FILING = "filing"


class Language(StrEnum):
    ZH = "zh"
    EN = "en"


class Polarity(StrEnum):
    POSITIVE = "positive"
    NEUTRAL = "neutral"
    NEGATIVE = "negative"


class Urgency(StrEnum):
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"
    CRITICAL = "critical"


class DeadLetterReason(StrEnum):
    NOT_UTF8 = "not_utf8"
    INVALID_JSON = "invalid_json"
    SCHEMA_VIOLATION = "schema_violation"
    EMPTY_TEXT = "empty_text"
    TOO_LONG = "too_long"
    MODEL_OUTPUT_INVALID = "model_output_invalid"
    GENERATION_FAILED = "generation_failed"
    UNREADABLE_RECORD = "unreadable_record"  # the Kafka client cannot parse it (e.g. a header key not UTF-8)
    ANSWER_REJECTED = "answer_rejected"  # the broker refused the record's answer (e.g. too large)
    INTERNAL_ERROR = "internal_error"  # a failure of ours while handling it: a bug to report


def event_id_for(
    topic: str, partition: int, offset: int, timestamp_ms: int | None, value: bytes | None
) -> str:
    """The id of whatever answers this record (analysis or dead letter).

    Bound to the record itself, not only to where it lies: offsets start again at 0 when a topic
    is re-created or a memory-only broker restarts, so coordinates alone would give a new record
    the id of an old one (and its answer). A re-delivered record keeps its timestamp and bytes,
    so it keeps its id; an id cannot be predicted without the record's content."""
    digest = "null" if value is None else hashlib.sha256(value).hexdigest()
    stamp = "none" if timestamp_ms is None else str(timestamp_ms)
    return str(uuid.uuid5(EVENT_ID_NAMESPACE, f"{topic}/{partition}/{offset}/{stamp}/{digest}"))


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DocumentEvent(_Wire):
    """A document to analyse, as published on an input topic (JSON form).

    Plain-text messages are accepted too; then the kind comes from the topic and the id from the
    message key (or the record coordinates when there is no key).
    """

    document_id: NonEmptyStr | None = Field(
        default=None, max_length=256, description="Defaults to the message key, else topic/partition/offset."
    )
    kind: KindName | None = Field(
        default=None,
        description="complaint, meeting_notes, filing, or a kind of the worker's KINDS_FILE; "
        "defaults to the kind of the input topic.",
    )
    text: NonEmptyStr
    language: Language | None = Field(default=None, description="Detected from the text when absent.")
    source_system: str | None = Field(default=None, max_length=256)
    submitted_at: datetime | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class SourceCoordinates(_Wire):
    topic: str
    partition: int = Field(ge=0)
    offset: int = Field(ge=0)
    timestamp_ms: int | None = Field(default=None, description="The record's Kafka timestamp (ms).")


class KeyInformation(_Wire):
    facts: list[Item] = Field(
        max_length=MAX_ITEMS, description="What the document states as having happened or being so."
    )
    data: list[Item] = Field(
        max_length=MAX_ITEMS, description="Figures, dates, amounts, identifiers, as written."
    )
    conclusions: list[Item] = Field(
        max_length=MAX_ITEMS, description="What the document concludes, decides or demands."
    )


class Sentiment(_Wire):
    polarity: Polarity = Field(description="Neutral only when the text expresses no attitude.")
    implies_doubt: bool = Field(description="The text questions or distrusts something (质疑).")
    implies_expectation: bool = Field(description="The text expects or demands something (期待).")
    rationale: Item
    confidence: float | None = Field(
        default=None, ge=0, le=1, description="The model's probability for this polarity among the three."
    )


class Triage(_Wire):
    urgency: Urgency = Field(description="On the scale of schemas.taxonomy.URGENCY_CRITERIA.")
    category: Category = Field(description="A routing queue of the closed taxonomy (schemas.taxonomy).")
    escalate: bool = Field(description="By rule: urgency high or critical.")
    safety_signals: list[str] = Field(
        default_factory=list,
        description="What the document names that set the urgency floor (injury, fire, legal_action…).",
    )


class Analysis(_Wire):
    """The three-part report; `triage` is present for complaints only."""

    core_viewpoint: Item = Field(description="One sentence stating the position.")
    key_information: KeyInformation
    sentiment: Sentiment
    triage: Triage | None = None
    fields: dict[FieldName, FieldValue] = Field(
        default_factory=dict,
        description="Answers to the kind's own fields (KINDS_FILE); empty for built-in kinds.",
    )
    suspected_injection: bool = Field(
        default=False, description="The document holds instruction-like text; it was withheld from the model."
    )
    injection_excerpts: list[Annotated[str, StringConstraints(max_length=200)]] = Field(
        default_factory=list,
        max_length=8,
        description="The withheld sentences, as written (cut to 200 characters).",
    )


class Narrative(_Wire):
    """What the model writes in its own words; the labels (polarity, doubt, expectation, category,
    urgency) are decided apart, as scored choices, and the two are joined into an `Analysis`."""

    core_viewpoint: Item
    key_information: KeyInformation
    rationale: Item
    fields: dict[FieldName, FieldValue] = Field(default_factory=dict)


class AnswerBounds(NamedTuple):
    """Characters a model may write per field, in one language; and the fewest in a viewpoint and a
    rationale (a sentence, not a label: without examples before the document, the 0.5B model
    answered "负面" for the viewpoint of 9 of 11 Chinese filings)."""

    viewpoint: int
    rationale: int
    item: int
    viewpoint_min: int
    rationale_min: int


# What a model may write, per language, and items per list: the limits the prompts state (a
# 40-word viewpoint, 25-word items; 60 and 40 characters in Chinese), with some room, and one
# short rationale sentence. Tighter than the wire model: a small model left to itself copies the
# document into every field up to whatever bound it is given, and the output's length is what an
# analysis costs (its latency and the engine's capacity). Worst case about 750 characters of
# Chinese or 1,850 of English, well within the generation budget (MAX_NEW_TOKENS, default 1,024).
# The bounds are about twice what the prompts ask for, so that a model keeping to the prompt never
# meets them; one that does is trimmed back to a word boundary by the parser (prompts.hygiene).
ANSWER_BOUNDS = {
    Language.ZH: AnswerBounds(120, 100, 80, viewpoint_min=12, rationale_min=8),
    Language.EN: AnswerBounds(300, 240, 200, viewpoint_min=30, rationale_min=20),
}
ANSWER_MAX_ITEMS = 3


def analysis_json_schema(kind: str, language: Language = Language.EN) -> dict[str, Any]:
    """The JSON Schema a model's answer must match for this kind and language: triage required for
    complaints, absent otherwise; lengths bounded. Handed to the engine's constrained decoder."""
    schema = Analysis.model_json_schema()
    bounds = ANSWER_BOUNDS[language]
    schema["properties"]["core_viewpoint"]["maxLength"] = bounds.viewpoint
    schema["$defs"]["Sentiment"]["properties"]["rationale"]["maxLength"] = bounds.rationale
    for name in ("facts", "data", "conclusions"):
        field_schema = schema["$defs"]["KeyInformation"]["properties"][name]
        field_schema["maxItems"] = ANSWER_MAX_ITEMS
        field_schema["items"]["maxLength"] = bounds.item
    del schema["properties"]["fields"]  # the built-in kinds have none
    if kind == DocumentKind.COMPLAINT:
        schema["properties"]["triage"] = {"$ref": "#/$defs/Triage"}
        schema["required"] = [*schema["required"], "triage"]
    else:
        del schema["properties"]["triage"]
        del schema["$defs"]["Triage"]
    return schema


def narrative_json_schema(
    language: Language, fields: Mapping[str, AnswerField] | None = None
) -> dict[str, Any]:
    """The JSON Schema of what the model writes (`Narrative`), bounded per language, with the
    kind's own `fields` (all required) when it has any; handed to the engine's constrained decoder."""
    schema = Narrative.model_json_schema()
    bounds = ANSWER_BOUNDS[language]
    schema["properties"]["core_viewpoint"]["maxLength"] = bounds.viewpoint
    schema["properties"]["core_viewpoint"]["minLength"] = bounds.viewpoint_min
    schema["properties"]["rationale"]["maxLength"] = bounds.rationale
    schema["properties"]["rationale"]["minLength"] = bounds.rationale_min
    for name in ("facts", "data", "conclusions"):
        field_schema = schema["$defs"]["KeyInformation"]["properties"][name]
        field_schema["maxItems"] = ANSWER_MAX_ITEMS
        field_schema["items"]["maxLength"] = bounds.item
    if not fields:
        del schema["properties"]["fields"]
        return schema
    text = {"type": "string", "minLength": 1, "maxLength": bounds.item}
    shapes = {"text": text, "list": {"type": "array", "items": text, "maxItems": ANSWER_MAX_ITEMS}}
    schema["properties"]["fields"] = {
        "type": "object",
        "properties": {name: shapes.get(f.type, {"type": "boolean"}) for name, f in fields.items()},
        "required": list(fields),
        "additionalProperties": False,
    }
    schema["required"] = [*schema["required"], "fields"]
    return schema


class Timings(_Wire):
    queued_ms: float = Field(ge=0, description="From consume to the engine's first forward pass.")
    time_to_first_token_ms: float = Field(ge=0, description="From consume to the first generated token.")
    total_ms: float = Field(ge=0, description="From consume to the analysis being ready to publish.")
    prompt_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)
    attempts: int = Field(ge=1, description="Generations run (2 when the repair attempt was needed).")


class EngineSettings(_Wire):
    dynamic_batching: bool
    kv_compression: bool
    max_batch_size: int = Field(ge=1)


class AnalysisEvent(_Wire):
    schema_version: Literal["1.2"] = SCHEMA_VERSION
    event_id: str
    document_id: str
    kind: KindName
    language: Language
    analysis: Analysis
    model: str
    timings: Timings
    engine: EngineSettings
    source: SourceCoordinates
    trace_id: str | None = Field(default=None, description="W3C trace id (32 hex) of this document's trace.")
    created_at: datetime


# A document sent with this header (the pages send it) has its analysis followed as it is written:
# `AnalysisProgress` records on TOPIC_PROGRESS. Others are not.
PROGRESS_HEADER = "deepanalyze-progress"


class AnalysisProgress(_Wire):
    """The analysis of a document as it is being written, for the page that sent it (records on
    TOPIC_PROGRESS, keyed by event id; only for documents sent with the `deepanalyze-progress`
    header). Best effort and unvalidated: the analysis event is the answer."""

    schema_version: Literal["1.2"] = SCHEMA_VERSION
    event_id: str
    document_id: str
    seq: int = Field(ge=1, description="Rises with each record of this document's progress.")
    analysis: dict[str, Any] = Field(
        description="Shaped like `Analysis`: the labels decided, then each field once it is complete."
    )


class Header(_Wire):
    key: str
    value_b64: str | None


class DeadLetter(_Wire):
    """A record that could not be analysed: the reason, and everything needed to replay it."""

    schema_version: Literal["1.2"] = SCHEMA_VERSION
    event_id: str
    document_id: str | None = None
    source: SourceCoordinates
    key_b64: str | None
    value_b64: str | None = Field(
        description="The original record value, base64 (its first bytes only when value_truncated)."
    )
    value_bytes: int | None = Field(default=None, ge=0, description="Length of the original value.")
    value_sha256: str | None = Field(default=None, description="SHA-256 of the whole original value, hex.")
    value_truncated: bool = Field(
        default=False,
        description="The value was too large to carry whole: the original stays at `source` in its topic.",
    )
    key_bytes: int | None = Field(default=None, ge=0, description="Length of the original key.")
    key_sha256: str | None = Field(default=None, description="SHA-256 of the whole original key, hex.")
    key_truncated: bool = Field(default=False, description="Only the key's first bytes are carried.")
    headers: list[Header]
    headers_truncated: bool = Field(
        default=False, description="Some headers, or the ends of long ones, were left out (bounded size)."
    )
    error_type: DeadLetterReason
    error_message: str
    attempts: int = Field(ge=0, description="Generations tried before giving up (0: rejected on decode).")
    raw_model_output: str | None = None
    trace_id: str | None = None
    created_at: datetime
