"""Turns a document into chat messages for the model: the labelling questions and the narrative.

Every prompt is the same system message and the document first, then the task: the document's
tokens are a shared prefix that the engine computes once and reuses for each question. Labels
(polarity, doubt, expectation, urgency, category) are asked as one-word questions whose answers
the engine scores over the allowed words (`Question.options`); the narrative (viewpoint, key
information, rationale) is written after, told the polarity decided.

Owns the templates and language detection. Knows nothing of tokenizers or the engine; the
caller applies the model's chat template to the messages returned here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from string import Template

from schemas import CATEGORY_LABELS, URGENCY_CRITERIA, Category, KindSpec, Language, Polarity, Urgency

# CJK Unified Ideographs (+ extension A) and CJK punctuation / full-width forms.
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\u3000-\u303f\uff00-\uffef]")
_LATIN = re.compile(r"[A-Za-z]")
_CLOSE_TAG = re.compile(r"</\s*document\s*>", re.IGNORECASE)
_OPEN_TAG = re.compile(r"<\s*document\s*>", re.IGNORECASE)

Message = dict[str, str]

# How a kind's own answer field is described to the model, by its type, and shown in the shape.
_FIELD_HINTS = {
    Language.ZH: {"text": "简短文字", "list": "最多 3 条简短文字的列表，没有就写 []", "boolean": "true 或 false"},
    Language.EN: {"text": "a short text", "list": "a list of up to 3 short texts, [] when none", "boolean": "true or false"},
}  # fmt: skip
_FIELD_RULE = {
    Language.ZH: '  - "{name}"：{description}（{hint}）',
    Language.EN: '  - "{name}": {description} ({hint})',
}
_FIELD_SHAPES = {"text": '"..."', "list": '["..."]', "boolean": "false"}
POLARITY_WORDS = {
    Language.ZH: {Polarity.POSITIVE: "正面", Polarity.NEGATIVE: "负面", Polarity.NEUTRAL: "中性"},
    Language.EN: {Polarity.POSITIVE: "positive", Polarity.NEGATIVE: "negative", Polarity.NEUTRAL: "neutral"},
}
_YES_NO = {Language.ZH: ("是", "否"), Language.EN: ("yes", "no")}
_GOOD_BAD = {Language.ZH: ("好", "坏"), Language.EN: ("good", "bad")}
# Every question that asks for the document's side, `polarity` first; the label policy combines
# the ones it names (`pipeline.labels.LabelPolicy.polarity_questions`).
POLARITY_QUESTIONS = ("polarity", "polarity_reversed", "outcome")
_URGENCY_WORDS = {
    Language.ZH: {Urgency.LOW: "低", Urgency.MEDIUM: "中", Urgency.HIGH: "高", Urgency.CRITICAL: "危急"},
    Language.EN: {
        Urgency.LOW: "low",
        Urgency.MEDIUM: "medium",
        Urgency.HIGH: "high",
        Urgency.CRITICAL: "critical",
    },
}


@dataclass(frozen=True)
class Prompt:
    kind: str
    language: Language
    messages: list[Message]


@dataclass(frozen=True)
class Question:
    """A label asked as a one-word answer: `options[i]` is the word that means `values[i]`."""

    name: str
    prompt: Prompt
    options: tuple[str, ...]
    values: tuple[str, ...]
    calibrate: bool = False  # divide out the model's preference measured on CONTENT_FREE inputs


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


@cache
def _labelled_examples(language: Language) -> tuple[tuple[Polarity, str], ...]:
    """The worked examples file: each example's polarity and text."""
    rows = (line.split("\t", 1) for line in _template(language, "examples").template.splitlines())
    return tuple((Polarity(label), text) for label, text in rows)


def worked_examples(language: Language) -> tuple[str, ...]:
    """The texts of the worked examples every label question in `language` shows the model."""
    return tuple(text for _, text in _labelled_examples(language))


@cache
def _examples(language: Language) -> tuple[Message, ...]:
    """Worked examples of the polarity question, as earlier turns of every label question: the same
    for all documents and questions, so the engine computes them once and reuses them."""
    words = POLARITY_WORDS[language]
    task = _template(language, "ask_polarity").template
    turns: list[Message] = []
    for label, text in _labelled_examples(language):
        user = _template(language, "document").substitute(document=text, task=task)
        turns += [{"role": "user", "content": user}, {"role": "assistant", "content": words[label]}]
    return tuple(turns)


@cache
def _system(language: Language) -> str:
    """The system message: the role, and every short question's definition and answer words, so
    that what follows a document is only a short cue (the document is the last shared prefix)."""
    zh = language is Language.ZH
    categories = [
        f"  - {label.zh if zh else label.en}{'：' if zh else ': '}{label.scope_zh if zh else label.scope}"
        for label in CATEGORY_LABELS.values()
    ]
    urgencies = [
        f"  - {_URGENCY_WORDS[language][Urgency(u)]}{'：' if zh else ': '}{rule.zh if zh else rule.en}"
        for u, rule in URGENCY_CRITERIA.items()
    ]
    return _template(language, "system").substitute(
        categories="\n".join(categories), urgencies="\n".join(urgencies)
    )


def _prompt(kind: str, language: Language, text: str, task: str, examples: bool = True) -> Prompt:
    """System, worked examples (when `examples`), then the document and the task."""
    user = _template(language, "document").substitute(document=fence(text.strip()), task=task)
    system = _system(language)
    messages = [
        {"role": "system", "content": system},
        *(_examples(language) if examples else ()),
        {"role": "user", "content": user},
    ]
    return Prompt(kind, language, messages)


# Contextual calibration (Zhao et al., 2021): a small model prefers one answer word whatever the
# text; its preference on inputs without content is measured and divided out of every answer but
# doubt and expectation (`Question.calibrate`): uncalibrated, it sent most team complaints to one
# queue ("服务态度" in Chinese, the first listed in English). Uncalibrated, the 0.5B model answered "no attitude" for
# 87 % of 600 real labelled reviews and news posts (bench/results/quality-cpu-0.5b-uncalibrated-attitude.json).
CONTENT_FREE = ("N/A", "", "[text]")


def questions(kind: KindSpec, language: Language, text: str) -> list[Question]:
    """The labelling questions for a document, polarity first (the others reuse its prefix).
    Polarity is asked as positive or negative; `attitude` (does the text evaluate at all?) decides
    neutral, which is narrow: a text that takes any side is not neutral. A triaged kind is also
    asked its queue and urgency."""
    yes, no = _YES_NO[language]
    words = POLARITY_WORDS[language]
    sides = (Polarity.POSITIVE, Polarity.NEGATIVE)

    def ask(name: str) -> Prompt:
        return _prompt(kind.name, language, text, _template(language, f"ask_{name}").template)

    asked = [
        Question("polarity", ask("polarity"), tuple(words[p] for p in sides), tuple(p.value for p in sides),
                 calibrate=True),
        # The same side asked twice more: with the answer words in the other order, and as "good or
        # bad for those concerned" (news about a firm has no writer's attitude to read).
        Question("polarity_reversed", ask("polarity_reversed"), tuple(words[p] for p in sides),
                 tuple(p.value for p in sides), calibrate=True),
        Question("outcome", ask("outcome"), _GOOD_BAD[language], tuple(p.value for p in sides), calibrate=True),
        Question("attitude", ask("attitude"), (yes, no), ("true", "false"), calibrate=True),
        Question("doubt", ask("doubt"), (yes, no), ("true", "false")),
        Question("expectation", ask("expectation"), (yes, no), ("true", "false")),
    ]  # fmt: skip
    if kind.triage:
        urgency = _URGENCY_WORDS[language]
        labels = [getattr(CATEGORY_LABELS[c], language.value) for c in Category]
        asked += [
            Question("category", ask("category"), tuple(labels), tuple(c.value for c in Category), calibrate=True),
            Question("urgency", ask("urgency"), tuple(urgency.values()), tuple(u.value for u in urgency),
                     calibrate=True),
        ]  # fmt: skip
    return asked


def render(kind: KindSpec, language: Language, text: str, polarity: Polarity = Polarity.NEUTRAL) -> Prompt:
    """The narrative prompt: viewpoint, key information, a rationale for `polarity`, and the
    kind's own fields; the kind's writing task (or the built-in one), then the answer's shape."""
    written = kind.narrative.of(language.value) if kind.narrative is not None else None
    task = Template(written or _template(language, "narrative").template).substitute(
        kind_name=kind.title.of(language.value), polarity=POLARITY_WORDS[language][polarity]
    )
    parts = [task]
    if kind.fields:
        rules = [
            _FIELD_RULE[language].format(
                name=name,
                description=field.description.of(language.value),
                hint=_FIELD_HINTS[language][field.type],
            )
            for name, field in kind.fields.items()
        ]
        parts.append(_template(language, "fields").substitute(rules="\n".join(rules)))
    shape = ", ".join(f'"{name}": {_FIELD_SHAPES[field.type]}' for name, field in kind.fields.items())
    parts.append(_template(language, "output").substitute(fields=f', "fields": {{{shape}}}' if shape else ""))
    # Without the worked examples: shown before the document, the 0.5B model wrote its analysis of
    # an example instead of the document (23 of 66 validity documents, 9 of 10 English reviews).
    return _prompt(kind.name, language, text, "\n".join(parts), examples=False)


def render_repair(prompt: Prompt, previous_output: str, error: str) -> Prompt:
    """The conversation extended with the model's invalid answer and a request to fix it."""
    repair = _template(prompt.language, "repair").substitute(error=error)
    messages = [
        *prompt.messages,
        {"role": "assistant", "content": previous_output},
        {"role": "user", "content": repair},
    ]
    return Prompt(prompt.kind, prompt.language, messages)
