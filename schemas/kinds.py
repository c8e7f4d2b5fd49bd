"""Kinds of document: what each is called in the prompts, where it arrives, whether it is triaged,
and the answer fields of its own that the model fills in besides the three-part report.

The three built-in kinds (complaint, meeting_notes, filing) need no configuration; a kinds file
(KINDS_FILE, TOML; `deploy/kinds.example.toml` documents it) adds others, e.g.:

    [kinds.support_ticket]
    topic = "docs.support-tickets"
    title = { zh = "技术支持工单", en = "support ticket" }
    triage = false

    [kinds.support_ticket.fields.product]
    description = { zh = "工单涉及的产品", en = "the product the ticket is about" }
    type = "text"          # text | list (of short texts) | boolean

Owns the shapes and their validation; reading the file is `pipeline.settings`' job.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from string import Template
from types import MappingProxyType
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

KindName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,39}$")]
FieldName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,39}$")]
MAX_FIELDS = 8
BUILT_IN = ("complaint", "meeting_notes", "filing")


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LocalText(_Spec):
    """One text per language of the analysis."""

    zh: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=2000)]
    en: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=2000)]

    def of(self, language: str) -> str:
        return self.zh if language == "zh" else self.en


class AnswerField(_Spec):
    """An answer field of a kind's own: what it asks for, per language, and its shape."""

    description: LocalText
    type: Literal["text", "list", "boolean"] = "text"


class KindSpec(_Spec):
    name: KindName
    topic: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._-]{1,249}$")]
    title: LocalText = Field(description="What the prompts call a document of this kind.")
    triage: bool = Field(default=False, description="Routed like complaints: queue, urgency, escalation.")
    narrative: LocalText | None = Field(
        default=None,
        description="The writing task per language ($kind_name and $polarity substituted); "
        "default: the built-in one.",
    )
    fields: dict[FieldName, AnswerField] = Field(default_factory=dict, max_length=MAX_FIELDS)

    @field_validator("narrative")
    @classmethod
    def _template_known_names(cls, value: LocalText | None) -> LocalText | None:
        for text in (value.zh, value.en) if value is not None else ():
            try:
                Template(text).substitute(kind_name="x", polarity="x")
            except (KeyError, ValueError) as exc:
                raise ValueError(f"only $kind_name and $polarity may be substituted ({exc})") from None
        return value


def built_in_kinds(complaints: str, meeting_notes: str, filings: str) -> dict[str, KindSpec]:
    """The three kinds that need no configuration, on the topics given (TOPIC_*)."""
    return {
        "complaint": KindSpec(
            name="complaint",
            topic=complaints,
            title=LocalText(zh="客户投诉", en="customer complaint"),
            triage=True,
        ),
        "meeting_notes": KindSpec(
            name="meeting_notes", topic=meeting_notes, title=LocalText(zh="会议纪要", en="meeting notes")
        ),
        "filing": KindSpec(
            name="filing", topic=filings, title=LocalText(zh="财务披露文件", en="financial filing")
        ),
    }


# With the default topics (those of TOPIC_COMPLAINTS, ... unset): for code that needs a built-in
# kind's prompts and not its topic (benchmarks, tests). A worker's kinds are its settings' `kinds`.
BUILT_IN_KINDS: Mapping[str, KindSpec] = MappingProxyType(
    built_in_kinds("docs.complaints", "docs.meeting-notes", "docs.filings")
)


def default_topic(name: str) -> str:
    """A kind's input topic when its file entry names none: docs.<name, with dashes>."""
    return "docs." + re.sub("_", "-", name)
