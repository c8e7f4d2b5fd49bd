"""Clean text rules for what a model writes: each a small pure function, applied by the parser and
counted by the quality benchmark (`bench/quality.py`).

1. No word cut by a bound: a field that ran into its length bound (`reached_bound`: within a
   token of it, not ending a sentence) is trimmed back to the last clause or word boundary and
   ended as a sentence (`trim_cut`).
2. No empty item: blank and filler items ("无", "N/A", "…", a field name such as "data") are
   dropped (`is_filler`).
3. The document's language throughout: an item mixing in the other language's words (those the
   document itself does not contain) is found (`foreign_words`).
4. No item repeated across facts / data / conclusions; data are figures (`sort_layers`).
5. A viewpoint states a position in a sentence, not a label like "客户投诉" (`is_label_viewpoint`),
   and does not open with the attitude word it was given (`without_attitude_lead`).
6. Nothing taken from the prompt's worked examples: a clause of an example that the document does
   not contain is the model copying the prompt, not reading the document (`copied_example`).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

from schemas import Language

_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]")
_LATIN_WORD = re.compile(r"[A-Za-z][A-Za-z'-]*")
_DIGIT = re.compile(r"[0-9０-９〇零一二三四五六七八九十百千万亿两半]")
_ARABIC = re.compile(r"[0-9０-９]")

FILLERS = frozenset(
    {"无", "暂无", "没有", "不详", "未提及", "未知", "无数据", "无结论", "n/a", "na", "none", "null", "nil",
     "unknown", "not mentioned", "not applicable", "no data", "nothing", "tbd", "-", "...",
     # the answer's own field names written as items ("• data", "• conclusions" in the demo)
     "facts", "data", "conclusions", "rationale", "core_viewpoint", "key_information", "事实", "数据", "结论"}
)  # fmt: skip

# Clause ends to trim back to, strongest first: sentence ends, then clause breaks.
_ZH_BREAKS = ("。", "！", "？", "；", "，", "、", "：")
_EN_BREAKS = (". ", "! ", "? ", "; ", ", ", ": ")

# Viewpoints that name the document instead of stating a position.
_ZH_LABEL = re.compile(
    r"^(这是|此为|本文是|该文档是)?(一[份篇条个])?(客户|用户|顾客|消费者)?(的)?"
    r"(投诉|反馈|评论|评价|抱怨|建议|会议纪要|会议记录|财务报告|财报|公告|披露文件|文件|分析|情况)(内容|说明|摘要)?$"
)
_EN_LABEL = re.compile(
    r"^(this is |it is )?(an? |the )?(customer |user |client )?(complaint|feedback|review|comment|meeting notes?|"
    r"minutes|financial (report|filing|analyst)|filing|report|analysis|summary|document)( summary| analysis)?$",
    re.IGNORECASE,
)


# The viewpoint's pattern as the prompts give it, and its placeholders.
_TEMPLATE_WORDS = re.compile(r"作者认为|要求|the writer holds that|and asks|\.\.\.|…", re.IGNORECASE)


def _letters(text: str) -> str:
    """Lower case, letters and digits only: the text as compared for duplicates and fillers."""
    return "".join(c for c in unicodedata.normalize("NFKC", text).lower() if c.isalnum())


def is_filler(item: str) -> bool:
    stripped = item.strip().strip("。．.，,；;：:！!？?…·-—_*\"'“”‘’()（）[]【】 ").lower()
    return not _letters(stripped) or stripped in FILLERS


# How far short of its bound the decoder may have had to close a text: the next token would not
# fit ("…the Company repurc" ended at 299 of 300 characters). About the longest token's length.
_SLACK = {Language.ZH: 4, Language.EN: 16}
_ENDS = ("。", "！", "？", ".", "!", "?", "…", "”", '"', "）", ")")


def reached_bound(text: str, bound: int, language: Language) -> bool:
    """The text ran into its bound: within a token of it and not ending a sentence."""
    return len(text) >= bound - _SLACK[language] and not text.endswith(_ENDS)


def trim_cut(text: str, bound: int, language: Language) -> str:
    """`text`, or when it ran into `bound` (the decoder closed it there, likely inside a word), its
    part up to the last clause or word boundary, ended as a sentence. Unchanged when no boundary
    exists."""
    if not reached_bound(text, bound, language):
        return text
    stop = "。" if language is Language.ZH else "."
    breaks = _ZH_BREAKS if language is Language.ZH else _EN_BREAKS
    for mark in breaks:
        at = text.rfind(mark)
        if at >= len(text) // 3:  # keep at least a third: a cut at the start says nothing
            kept = text[: at + 1].rstrip(" ,;:，、；：")
            return kept if kept.endswith(_ENDS) else kept + stop
    if language is Language.EN and (at := text.rfind(" ")) >= len(text) // 3:
        return text[:at].rstrip(" ,;:") + stop
    return text


def foreign_words(text: str, language: Language, document: str) -> list[str]:
    """Words of the other language in `text` that the document does not contain: Latin words of
    two or more letters inside Chinese output, CJK characters inside English output. Names,
    models and acronyms copied from the document are fine."""
    if language is Language.ZH:
        lowered = document.lower()
        return [w for w in _LATIN_WORD.findall(text) if len(w) >= 2 and w.lower() not in lowered]
    return [c for c in _CJK.findall(text) if c not in document]


def is_data(item: str) -> bool:
    """A data item holds a figure: a digit, or a Chinese numeral."""
    return bool(_DIGIT.search(item))


def sort_layers(facts: list[str], data: list[str], conclusions: list[str]) -> tuple[list[str], ...]:
    """Fillers dropped; data without a figure moved to facts; an item already said (the same
    letters, or contained in an earlier item) dropped wherever it comes again."""
    moved = [d for d in data if not is_data(d)]
    layers = ([*facts, *moved], [d for d in data if is_data(d)], list(conclusions))
    seen: list[str] = []
    out: list[list[str]] = []
    for layer in layers:
        kept = []
        for item in layer:
            key = _letters(item)
            if is_filler(item) or any(_same(key, earlier) for earlier in seen):
                continue
            seen.append(key)
            kept.append(item)
        out.append(kept)
    return tuple(out)


def _same(a: str, b: str) -> bool:
    return a == b or (min(len(a), len(b)) >= 6 and (a in b or b in a))


# A viewpoint that opens with the attitude it was told ("负面，董事会建议…", "Negative: the writer…").
_ATTITUDE_LEAD = re.compile(
    r"^\s*(正面|负面|中性|积极|消极|positive|negative|neutral)\s*[，,：:。.;；]\s*", re.IGNORECASE
)


def without_attitude_lead(text: str) -> str:
    """`text` without an opening attitude word: the attitude is a label of its own, not the viewpoint."""
    rest = _ATTITUDE_LEAD.sub("", text, count=1)
    return rest[:1].upper() + rest[1:] if rest and rest != text else text


def is_label_viewpoint(text: str, language: Language) -> bool:
    """The viewpoint names the document ("客户投诉", "Financial Analyst") or is too short to
    state a position (fewer than 6 Chinese characters, or 4 English words, besides the prompt's
    own pattern "作者认为……，要求……" / "The writer holds that …, and asks …")."""
    stripped = text.strip().strip("。.！!")
    unfilled = _TEMPLATE_WORDS.sub(" ", stripped)
    if language is Language.ZH:
        return bool(_ZH_LABEL.match(stripped)) or len(_CJK.findall(unfilled)) < 6
    words = [w for w in unfilled.split() if any(c.isalnum() for c in w)]
    return bool(_EN_LABEL.match(stripped)) or len(words) < 4


_CLAUSE_BREAK = re.compile(r"[。！？；，、：.!?;,:]")


def copied_example(text: str, examples: Sequence[str], document: str) -> str | None:
    """The first clause of a worked example (10 letters or more, a Chinese character counting two)
    that `text` repeats and the document does not contain, or None."""
    mine, source = _letters(text), _letters(document)
    for example in examples:
        for clause in _CLAUSE_BREAK.split(example):
            key = _letters(clause)
            if len(key) + len(_CJK.findall(key)) >= 10 and key in mine and key not in source:
                return clause.strip()
    return None
