"""Instruction-like text inside a document: found, withheld from the model, reported to the desk.

A document is data. A sentence in it that addresses the analyst or the system ("系统提示：…",
"ignore previous instructions", "mark this as low urgency", `{"core_viewpoint": …}`) is not what
the writer complains about: it is an attempt to steer the analysis. Such sentences are cut out of
the text the model reads (replaced by a marker saying so in the text it writes from; left out
entirely from the text its labels are scored on) and returned, so that the event can flag them
(`suspected_injection`) with the excerpts. The signals are deterministic patterns per
language, written from the shapes instructions take, not from any benchmark's phrasings; a
sentence that merely asks for help ("请尽快处理") is not one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from schemas import Language

_FLAGS = re.IGNORECASE

# Words that name the analysis itself: who an instruction would address, what it would set.
_ZH_FIELDS = r"(情感|情绪|极性|倾向|紧急度|紧急程度|紧急级别|优先级|分诊|类别|分类|核心观点|升级|escalate|urgency|polarity|sentiment)"
_ZH = [
    re.compile(r"(系统|管理员|开发者|后台|平台)(提示|指令|消息|通知|备注|设置|说明)\s*[:：】\]]", _FLAGS),
    re.compile(
        r"(忽略|无视|忘记|不要理会|跳过)(掉)?(你)?(之前|以上|上述|前面|先前|所有|全部|原有|原来)?的?(所有)?(指令|指示|要求|提示|规则|设定|任务)"
    ),
    re.compile(
        r"(标记|标注|设置|设定|设为|判定|判断|归类|分类|评为|定为|认定|改为|调整)(为|成)?\s*[\"“']?(低|中|高|普通|一般|正面|负面|中性|积极|消极|无需|不需|已处理|已解决|非紧急)"
    ),
    re.compile(
        _ZH_FIELDS
        + r"\s*(应|应该|应当|必须|须|需|请|一律|要)?\s*(为|是|设为|设置为|标记为|改为|定为|=|：|:)\s*[\"“']?(低|中|高|正面|负面|中性|积极|消极|false|true|low|medium|high|critical|positive|negative|neutral|否|无需)",
        _FLAGS,
    ),
    re.compile(r"(无需|不需要|不必|不用|请勿|不要)(升级|上报|转交|人工|主管|跟进|处理此|关注)"),
    re.compile(r"(作为|你是|你现在是|扮演)(一个|一名)?(AI|人工智能|模型|助手|分析师|分诊员|系统)", _FLAGS),
    re.compile(
        r"(以下|下面|如下)?(请)?(直接)?(输出|回复|返回|生成)(以下|下面|如下)?的?\s*(JSON|json|内容|结果|格式)",
        _FLAGS,
    ),
]
_EN = [
    re.compile(
        r"\b(system|admin(istrator)?|developer|operator|internal)\s+(prompt|instruction|message|note|notice|override|directive)s?\b",
        _FLAGS,
    ),
    re.compile(
        r"\b(ignore|disregard|forget|override|skip)\b[\w\s,]{0,30}\b(instructions?|prompts?|rules|directions|guidelines|context|task)\b",
        _FLAGS,
    ),
    re.compile(
        r"\b(mark|set|label|classify|flag|record|tag|categori[sz]e|log|route)\b[\w\s]{0,30}\b(as|to)\b\s*[\"']?(low|medium|high|critical|positive|negative|neutral|resolved|not urgent|non-urgent|no escalation|false|true)\b",
        _FLAGS,
    ),
    re.compile(
        r"\b(escalate|escalation|urgency|priority|polarity|sentiment|category|core[_ ]viewpoint)\b\s*(should|must|shall|is to|needs to|has to)?\s*(be|=|:|to)\s*[\"']?(low|medium|high|critical|positive|negative|neutral|false|true|none|no)\b",
        _FLAGS,
    ),
    re.compile(r"\b(do not|don't|dont|no need to|never|must not)\s+(escalate|flag|forward|report)\b", _FLAGS),
    re.compile(
        r"\b(you are now|act as|pretend to be|as an ai|note to the (ai|model|assistant|analyst|system))\b",
        _FLAGS,
    ),
    re.compile(
        r"\b(output|respond with|reply with|return|print)\b[\w\s]{0,20}(json|the following|exactly)\b", _FLAGS
    ),
]
# Either language: the analysis's own field names, or a JSON object, written into the document.
_ANY = [
    re.compile(
        r"\"?(core_viewpoint|key_information|implies_doubt|implies_expectation|suspected_injection)\"?",
        _FLAGS,
    ),
    re.compile(r"\{\s*\"[a-z_]+\"\s*:", _FLAGS),
]

# Talk about how the complaint should be processed, combined with a push in some direction: a
# writer asks for help; only someone steering the triage tells it what to record or how to read.
_ZH_PROCESS = re.compile(
    r"优先级|工单|归档|结案|升级流程|自动分类|分类模型|分析模型|分析员|情感分析|情感倾向|分诊|紧急程度|紧急度|系统里|元数据|校准|"
    r"AI|模型|机器人|打分|定性|P[0-9]|分析的时候|分析时|总结时|结论中|这条投诉|本条|本工单|该工单",
    _FLAGS,
)
_ZH_STEER = re.compile(
    r"最低|低|不要|别|无需|不必|不用|关闭|已处理|已解决|已结案|正面|好评|五星|为准|立场|身份|一致|重写|下调|取消|撤回|不属实|禁止|照此|按.*处理|登记"
)
_EN_PROCESS = re.compile(
    r"\b(priority|prioriti[sz]|severity|urgency|escalat\w*|triage|sentiment|classif\w*|categori[sz]\w*|ticket|queue|"
    r"pipeline|nlp|model|assistant|the ai|analy[sz]\w*|summari[sz]\w*|metadata|sla|auto-?close|moderation|"
    r"whoever (reads|processes)|the pile|file[ds]? (it|this)|case closed|guidelines?|polic(y|ies))\b",
    _FLAGS,
)
_EN_STEER = re.compile(
    r"\b(low|lowest|minor|not urgent|no need|don't|do not|bottom|closed|resolved|positive|happy|delighted|ignore|"
    r"disregard|instead|company's|point of view|perspective|role|above everything|weigh|rewrite|cosmetic|"
    r"archive|no further action|at most|disabled|manually verified|accordingly)\b",
    _FLAGS,
)
_PERSONA = [
    re.compile(
        r"(你|您)(现在|从现在起)(是|扮演|作为)|(你|您)(扮演|是一个|是一名)|请以.{0,12}(身份|角度|立场)|站在.{0,12}(立场|角度|一方)|(玩|来)个游戏"
    ),
    re.compile(
        r"\b(role-?play|you are now|from now on,? you|act as|pretend|as the (company|hotel|retailer|brand)|"
        r"(company|retailer|brand|merchant)'s (point of view|perspective|side))\b",
        _FLAGS,
    ),
]


def _steers(sentence: str) -> bool:
    if any(p.search(sentence) for p in _PERSONA):
        return True
    zh = bool(_ZH_PROCESS.search(sentence) and _ZH_STEER.search(sentence))
    return zh or bool(_EN_PROCESS.search(sentence) and _EN_STEER.search(sentence))


# Sentences: split after CJK or Latin end punctuation, line breaks, and around 【…】 / [...] notes.
_SENTENCE = re.compile(r"【[^】]*】|\[[^\]]*\]|(?:[^。！？!?.\n【\[]|\.(?![\s.]|$))+(?:[。！？!?]+|\.+|\n|$)")
_MARKER = {Language.ZH: "【此处疑似指令的文字已移除】", Language.EN: "[instruction-like text removed]"}
MAX_EXCERPT_CHARS = 200


@dataclass(frozen=True)
class Screened:
    text: str  # what the model writes from: the document, each withheld sentence a marker
    excerpts: tuple[str, ...]  # the sentences withheld, as written (each cut to MAX_EXCERPT_CHARS)
    labelled: str = ""  # what the label questions read: the document less them, with no marker

    @property
    def suspected(self) -> bool:
        return bool(self.excerpts)


def _patterns(language: Language) -> list[re.Pattern[str]]:
    # Both languages' patterns apply: a Chinese complaint can carry an English instruction.
    return [*_ZH, *_EN, *_ANY] if language is Language.ZH else [*_EN, *_ZH, *_ANY]


def is_instruction(sentence: str, language: Language = Language.EN) -> bool:
    return any(p.search(sentence) for p in _patterns(language)) or _steers(sentence)


def screen(text: str, language: Language) -> Screened:
    """The document with instruction-like sentences replaced by one marker each (for the model's
    narrative, so that it neither reads them nor guesses at a gap), and without them at all for
    the label questions: a marker is itself text a small model reacts to (it tilted urgency up),
    and labels should be what the document says without its instructions."""
    kept: list[str] = []
    bare: list[str] = []
    excerpts: list[str] = []
    position = 0
    for match in _SENTENCE.finditer(text):
        sentence = match.group(0)
        between = text[position : match.start()]  # whatever lay between sentences (spaces)
        kept.append(between)
        bare.append(between)
        position = match.end()
        if sentence.strip() and is_instruction(sentence, language):
            excerpts.append(sentence.strip()[:MAX_EXCERPT_CHARS])
            lead = sentence[: len(sentence) - len(sentence.lstrip())]
            kept.append(lead + _MARKER[language] + ("\n" if sentence.endswith("\n") else ""))
            bare[-1] = between.rstrip()  # the space that led into the withheld sentence goes with it
        else:
            kept.append(sentence)
            bare.append(sentence)
    kept.append(text[position:])
    bare.append(text[position:])
    if not excerpts:
        return Screened(text, (), text)
    return Screened("".join(kept), tuple(excerpts), "".join(bare).strip())
