"""Clean text rules for what a model writes: each a small pure function, applied by the parser and
counted by the quality benchmark (`bench/quality.py`).

1. No word cut by a bound: a field that ran into its length bound is trimmed back to the last
   clause or word boundary (`trim_cut`).
2. No empty item: blank and filler items ("无", "N/A", "…") are dropped (`is_filler`).
3. The document's language throughout: an item mixing in the other language's words (those the
   document itself does not contain) is found (`foreign_words`).
4. No item repeated across facts / data / conclusions; data are figures (`sort_layers`).
5. A viewpoint states a position in a sentence, not a label like "客户投诉" (`is_label_viewpoint`).
"""

from __future__ import annotations

import re
import unicodedata

from schemas import Language

_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]")
_LATIN_WORD = re.compile(r"[A-Za-z][A-Za-z'-]*")
_DIGIT = re.compile(r"[0-9０-９〇零一二三四五六七八九十百千万亿两半]")
_ARABIC = re.compile(r"[0-9０-９]")

FILLERS = frozenset(
    {"无", "暂无", "没有", "不详", "未提及", "未知", "无数据", "无结论", "n/a", "na", "none", "null", "nil",
     "unknown", "not mentioned", "not applicable", "no data", "nothing", "tbd", "-", "..."}
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


def _letters(text: str) -> str:
    """Lower case, letters and digits only: the text as compared for duplicates and fillers."""
    return "".join(c for c in unicodedata.normalize("NFKC", text).lower() if c.isalnum())


def is_filler(item: str) -> bool:
    stripped = item.strip().strip("。．.，,；;：:！!？?…·-—_*\"'“”‘’()（）[]【】 ").lower()
    return not _letters(stripped) or stripped in FILLERS


def trim_cut(text: str, bound: int, language: Language) -> str:
    """`text`, or when it reached `bound` characters (the decoder closed it there, likely inside a
    word), its part up to the last clause or word boundary. Unchanged when no boundary exists."""
    if len(text) < bound:
        return text
    breaks = _ZH_BREAKS if language is Language.ZH else _EN_BREAKS
    for mark in breaks:
        at = text.rfind(mark)
        if at >= len(text) // 3:  # keep at least a third: a cut at the start says nothing
            return text[: at + 1].rstrip(" ,;:，、；：")
    if language is Language.EN and (at := text.rfind(" ")) >= len(text) // 3:
        return text[:at].rstrip(" ,;:")
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


def is_label_viewpoint(text: str, language: Language) -> bool:
    """The viewpoint names the document ("客户投诉", "Financial Analyst") or is too short to
    state a position (fewer than 6 Chinese characters, or 4 English words)."""
    stripped = text.strip().strip("。.！!")
    if language is Language.ZH:
        return bool(_ZH_LABEL.match(stripped)) or len(_CJK.findall(stripped)) < 6
    return bool(_EN_LABEL.match(stripped)) or len(stripped.split()) < 4
