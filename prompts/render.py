"""Turns a document into chat messages for the model: kind × language instruction + delimited data.

Owns the templates and language detection. Knows nothing of tokenizers or the engine; the
caller applies the model's chat template to the messages returned here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from string import Template

from schemas import DocumentKind, Language

# CJK Unified Ideographs (+ extension A) and CJK punctuation / full-width forms.
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\u3000-\u303f\uff00-\uffef]")
_LATIN = re.compile(r"[A-Za-z]")
_CLOSE_TAG = re.compile(r"</\s*document\s*>", re.IGNORECASE)
_OPEN_TAG = re.compile(r"<\s*document\s*>", re.IGNORECASE)

Message = dict[str, str]


@dataclass(frozen=True)
class Prompt:
    kind: DocumentKind
    language: Language
    messages: list[Message]


def detect_language(text: str) -> Language:
    """Chinese when CJK characters make up a fair share of the letters, else English."""
    num_cjk = len(_CJK.findall(text))
    num_latin = len(_LATIN.findall(text))
    # One CJK character carries about a word; Latin letters come ~5 to a word.
    return Language.ZH if num_cjk * 5 >= num_latin and num_cjk > 0 else Language.EN


@cache
def _template(language: Language, name: str) -> Template:
    path = resources.files("prompts") / "templates" / language.value / f"{name}.txt"
    return Template(path.read_text(encoding="utf-8").strip("\n"))


def fence(text: str) -> str:
    """The document as inert data: its own <document> tags cannot close or reopen the fence."""
    text = _CLOSE_TAG.sub("[/document]", text)
    return _OPEN_TAG.sub("[document]", text)


def render(kind: DocumentKind, language: Language, text: str) -> Prompt:
    is_complaint = kind is DocumentKind.COMPLAINT
    shape = _template(language, "shape").substitute(
        triage=_template(language, "triage").template if is_complaint else "",
        triage_rules="\n" + _template(language, "triage_rules").template if is_complaint else "",
    )
    user = _template(language, kind.value).substitute(shape=shape, document=fence(text.strip()))
    system = _template(language, "system").template
    return Prompt(kind, language, [{"role": "system", "content": system}, {"role": "user", "content": user}])


def render_repair(prompt: Prompt, previous_output: str, error: str) -> Prompt:
    """The conversation extended with the model's invalid answer and a request to fix it."""
    repair = _template(prompt.language, "repair").substitute(error=error)
    messages = [
        *prompt.messages,
        {"role": "assistant", "content": previous_output},
        {"role": "user", "content": repair},
    ]
    return Prompt(prompt.kind, prompt.language, messages)
