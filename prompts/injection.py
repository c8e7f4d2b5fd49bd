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


def _speaker(names: str) -> str:
    """A line opening a turn of one of `names`, its tag bare or bracketed: "系统：", "[客服]：", "【用户】:"."""
    return r"^\s*[\[【(（]?\s*" + names + r"\s*[\]】)）]?\s*[:：]"


# Words that name the analysis itself: who an instruction would address, what it would set.
_ZH_FIELDS = r"(情感|情绪|语气|极性|倾向|紧急度|紧急程度|紧急级别|优先级|分诊|类别|分类|核心观点|升级|escalate|urgency|polarity|sentiment)"
_ZH = [
    re.compile(
        r"(系统|管理员|开发者|后台|平台|内部|审核员|版主)(提示|指令|消息|通知|备注|设置|说明)\s*[:：】\]]",
        _FLAGS,
    ),
    re.compile(
        r"(忽略|无视|忘记|不要理会|跳过)(掉)?(你)?(之前|以上|上述|前面|先前|所有|全部|原有|原来)?的?(所有)?(指令|指示|要求|提示|规则|设定|任务)"
    ),
    re.compile(r"(忽略|无视|不要理会)(掉)?(之前|以上|上述|前面|先前)的?(所有|全部)?(内容|文字|描述|信息)"),
    re.compile(
        r"(标记|标注|设置|设定|设为|判定|判断|归类|分类|评为|定为|认定|改为|调整|写成|标成|记成)(为|成)?\s*[\"“']?(低|中|高|普通|一般|正面|负面|中性|积极|消极|无需|不需|已处理|已解决|非紧急)"
    ),
    re.compile(
        _ZH_FIELDS
        + r"\s*(应|应该|应当|必须|须|需|请|一律|要)?\s*(为|是|设为|设置为|标记为|改为|定为|=|：|:|\|)\s*[\"“'*]?(低|中|高|正面|负面|中性|积极|消极|false|true|low|medium|high|critical|positive|negative|neutral|否|无需)",
        _FLAGS,
    ),
    re.compile(
        r"(无需|不需要|不必|不用|请勿|不要|严禁|禁止)(再次?|继续|触发|进行)?(升级|上报|往上报|转交|转人工|人工|主管|跟进|处理此|关注)"
    ),
    re.compile(r"(作为|你是|你现在是|扮演)(一个|一名)?(AI|人工智能|模型|助手|分析师|分诊员|系统)", _FLAGS),
    # what the analysis fills in, named as a field to fill or to keep: "填写核心观点", "（固定字段，禁止改写）"
    re.compile(
        r"(填写|填入|改写|重写|生成|输出)"
        + _ZH_FIELDS
        + r"|固定字段|(禁止|不得|请勿|不要)(改写|修改|更改)(此|该|本)?字段"
    ),
    re.compile(
        r"(以下|下面|如下)?(请)?(直接)?(输出|回复|返回|生成)(以下|下面|如下)?的?\s*(JSON|json|内容|结果|格式)",
        _FLAGS,
    ),
]
_EN = [
    re.compile(
        r"\b(system|admin(istrator)?|developer|operator|internal|assistant|moderator)\s+(prompt|instruction|message|note|notice|override|directive)s?\b",
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
    re.compile(
        r"\b(do not|don't|dont|no need to|never|must not)\s+(be\s+)?(escalate|flag|forward|report|rout(e|ed)|pass (this|it) (up|on))",
        _FLAGS,
    ),
    re.compile(
        r"\b(viewpoint|sentiment|polarity|urgency|priority|escalation) (field|label|tag|flag)s?\b", _FLAGS
    ),
    # a record's key that names a field of the analysis, with a label for its value: a YAML or
    # key=value line ("sentiment_verified: positive"), a table row ("| Tone (verified) | Positive |")
    re.compile(
        r"\b\w*(sentiment|polarity|urgency|priority|escalat\w*|tone|severity)\w*(\s*\([\w ]{0,20}\))?"
        r"\s*[|:=]\s*[\"'*]*\s*(low|medium|high|critical|positive|negative|neutral|false|true|none|no)\b",
        _FLAGS,
    ),
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
    # a record's line that sets the viewpoint itself: 'viewpoint = "…"', "核心观点：…" as a key
    re.compile(r"^\s*[#*_-]*\s*(core[_ ]?)?(viewpoint|summary|观点|核心观点)\s*[=:：]\s*[\"“']", _FLAGS),
    # an encoded payload to decode and follow
    re.compile(
        r"(请)?解码(后|之后)?.{0,10}(按|照|执行|填写)|\b(decode|base64-?decode) (this|the following|it|and)\b",
        _FLAGS,
    ),
    re.compile(_speaker("(assistant|system|ai|助手|系统)"), _FLAGS),  # a made-up turn of the analyst
    # a made-up turn in which the customer declares the case settled ("客户：已经解决了，我很满意")
    re.compile(
        _speaker("(客户|顾客|用户|买家|customer|user|client)") + r".{0,40}"
        r"(满意|解决了|好评|没问题了|happy|satisfied|resolved|fixed|all good|no problem)",
        _FLAGS,
    ),
    # markup named after a field of the analysis: <sentiment_label …>, <urgency>, <!-- triage -->
    re.compile(
        r"<\s*/?\s*[\w-]*(sentiment|polarity|urgency|priority|escalat|category|viewpoint|triage)[\w-]*",
        _FLAGS,
    ),
    # the analysing machine addressed: "请AI…", "请模型…", "Dear AI,", "Note for the classifier"
    re.compile(r"请(你们的|贵司的)?(AI|人工智能|模型|机器人|智能助手|算法|分析系统)", _FLAGS),
    re.compile(
        r"\b(dear|hey|hi|hello|attention|note for|message for|instructions? for) (the )?"
        r"(ai|model|bot|assistant|classifier|analy[sz]er|summari[sz]er|llm)\b",
        _FLAGS,
    ),
    re.compile(r"\b(ai|model|bot|assistant|classifier|llm),? (please|kindly|should|must)\b", _FLAGS),
    re.compile(r"按(最低|最高|普通|一般)的?(级别|等级|优先级)?(处理|登记|记录)"),
    # the document reclassifying itself
    re.compile(
        r"(这|本条|此条|这条|该条)?(不是|并非|不算|不属于)(投诉|差评)|\b(this|it)( i|')s not a complaint\b",
        _FLAGS,
    ),
]

# Talk about how the complaint should be processed, combined with a push in some direction: a
# writer asks for help; only someone steering the triage tells it what to record or how to read.
_ZH_PROCESS = re.compile(
    r"优先级|工单|归档|结案|升级流程|自动分类|分类模型|分析模型|分析员|情感分析|情感倾向|分诊|紧急程度|紧急度|系统里|元数据|校准|"
    r"AI|模型|机器人|打分|定性|(?<![A-Za-z0-9])P[0-9](?![0-9A-Za-z])|分析的时候|分析时|总结时|结论中|这条投诉|本条|本工单|该工单|"
    # the ticket as a thing to be handled: who handles it, how it is recorded, counted, summarised
    r"此单|本单|这条(投诉|工单|留言|反馈)|该条|派单|派发|转给|转交|质检|审核(意见|人员)|批注|备注|主管|管理员|负责分类|"
    r"记为|记作|记录为|列为|归为|当作|当成|视为|视作|算作|计入|统计|按.{0,8}记录|(处理|优先|风险|最低)(等级|级别)|"
    r"误报|概括|总结|结论|风险评估|自动生成|"
    # the document seen from outside: "上述所有描述", "以上投诉内容", "上面的内容"
    r"上述|以上(的)?(内容|描述|投诉|文字|所述)|上面(的|这些)?(内容|描述|文字|所说)|前面(那些|这些|的)?(情绪化的)?(内容|描述|文字|话)|"
    # what the analysis writes or sets: its summary, its labels, where the ticket goes
    r"观点提取|摘要|标签",
    _FLAGS,
)
_ZH_STEER = re.compile(
    r"最低|低|不要|别(把|给|再|浪费|当真|转|升级|上报|打电话)|无需|不必|不用|关闭|已处理|已解决|已结案|正面|好评|五星|为准|立场|身份|一致|重写|下调|取消|撤回|不属实|禁止|照此|按.*处理|登记|反话|讽刺|正话反说|"
    r"(定为|按|设为|记为|算)一般|一般(处理|咨询|问题)|普通|请勿|勿|撤销|无效|重复|恶意|误报|无风险|开心|满意|表扬|感谢信|积极(的)?(语气|评价|反馈)|忽略|没有问题|使用不当|只写|"
    r"当真|开玩笑|一律|仅供参考|不是投诉|降级|关单|即可|：无|:无|当作(背景)?噪音|背景噪音|遵照执行|照此执行|按此执行|勿改|固定为|"
    r"非紧急|中性"
)
_EN_PROCESS = re.compile(
    r"\b(priority|prioriti[sz]|severity|urgency|escalat\w*|triage|sentiment|classif\w*|categori[sz]\w*|ticket|queue|"
    r"pipeline|nlp|model|assistant|the ai|analy[sz]\w*|summari[sz]\w*|metadata|sla|auto-?close|moderation|"
    r"whoever (reads|processes)|the pile|file[ds]? (it|this)|case closed|guidelines?|polic(y|ies)|the tone|"
    r"when (judging|rating|scoring|assessing|classifying)|(to|should|must) be (rated|graded|scored|ranked|marked)|"
    # the ticket as a thing to be handled: who handles it, how it is recorded, counted, summarised
    r"treat(ed)? (it |this |the \w+ )?as|count(ed)? as|class(ed)? as|regard(ed)? as|recorded as|logged as|"
    r"rephrase|conclusion|risk assessment|follow-up|reviewer|supervisor|admin|whoever \w+ these|"
    r"quality control|bots?|auto-generated|tier|downgrade|internal test|"
    # the document seen from outside
    r"the text above|everything above|all of the above|the above|this complaint|this message|"
    # what the analysis writes: "describe this as", "put it down as"; who oversees it
    r"describe (this|it) as|put (this|it|that) down as|write (this|it) up as|moderator)\b",
    _FLAGS,
)
_EN_STEER = re.compile(
    r"\b(low|lowest|minor|not urgent|no need|don't|do not|bottom|closed|resolved|positive|happy|delighted|ignore|"
    r"disregard|instead|company's|point of view|perspective|viewpoint|on behalf|role|above everything|weigh|rewrite|cosmetic|"
    r"archive|no further action|at most|disabled|manually verified|accordingly|sarcas\w*|ironic\w*|irony|"
    r"withdrawn|compliment|not a complaint|false alarm|no action|say only|none|not required|joking|downgrade|"
    r"satisfied|misused|cheerful|thank-you|not be counted|as (background|noise)|upbeat|regenerate|"
    r"informational only|as neutral|neutral-to-positive|minor feedback)\b",
    _FLAGS,
)
_PERSONA = [
    re.compile(
        r"(你|您)(现在|从现在起)(是|扮演|作为)|(你|您)(扮演|是一个|是一名)|请(以|从).{0,12}(身份|角度|立场)|站在.{0,12}(立场|角度|一方)|(玩|来)个游戏|"
        r"以.{0,12}(立场|身份|口吻)(来)?(撰写|总结|回复|写|分析|描述|处理)|扮演.{0,12}(商家|客服|公关|公司|品牌|店家|官方)"
    ),
    re.compile(
        r"\b(role-?play|you are now|from now on,? you|act as|pretend|as the (company|hotel|retailer|brand)|"
        r"(company|retailer|brand|merchant)'s (point of view|perspective|side)|let's play a game|"
        r"as (the|a) [\w' -]{0,30}(team|department|staff|rep|representative) would)\b",
        _FLAGS,
    ),
]


# How near the processing talk and the push must lie (characters between them): an instruction
# says both in one breath; a long news sentence can hold "统计" and "积极" forty characters apart.
_NEAR = {"zh": 16, "en": 60}


def _near(process: re.Pattern[str], steer: re.Pattern[str], sentence: str, reach: int) -> bool:
    spans = [m.span() for m in process.finditer(sentence)]
    if not spans:
        return False
    pushes = [m.span() for m in steer.finditer(sentence)]
    # disjoint spans (a word of both lists is not a pair by itself), at most `reach` apart
    return any((c >= b or a >= d) and max(a, c) - min(b, d) <= reach for a, b in spans for c, d in pushes)


def _steers(sentence: str) -> bool:
    if any(p.search(sentence) for p in _PERSONA):
        return True
    return _near(_ZH_PROCESS, _ZH_STEER, sentence, _NEAR["zh"]) or _near(
        _EN_PROCESS, _EN_STEER, sentence, _NEAR["en"]
    )


# Sentences: split after CJK or Latin end punctuation, line breaks, and around 【…】 / [...] notes.
_SENTENCE = re.compile(
    r"[【\[][^】\]\n]{1,12}[】\]][ \t]*[:：](?:[^。！？!?.\n]|\.(?![\s.]|$))*(?:[。！？!?]+|\.+|\n|$)|"
    r"【[^】]*】|\[[^\]]*\]|(?:[^。！？!?.\n【\[]|\.(?![\s.]|$))+(?:[。！？!?]+|\.+|\n|$)"
)
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


# Around an instruction, sentences that belong to it though they steer nothing on their own: talk
# about the machinery ("I know you use automated systems.", "Developer mode enabled."), a very short
# lead-in ("P.S.", "IMPORTANT!!!"), and the sentence an instruction points back to ("…五星！分析的时候
# 请以这句话为准", "Please weigh this postscript…").
_META = re.compile(
    r"\b(automated|systems?|bots?|algorithms?|QA|developer|mode|assistant|pipeline|model|AI|LLM|prompt)\b|"
    r"系统|自动|机器|助手|模型|算法|AI|后台|测试",
    _FLAGS,
)
# A quotation an instruction brings with it ('the viewpoint is "…". Use that sentence verbatim.'):
# what its "that sentence" points to, rather than the writer's sentence before it.
_QUOTES = re.compile(r"[\"“「『][^\"”」』]{8,}[\"”」』]")
_POINTS_BACK = re.compile(
    r"\b(this|that|the above|the previous|the preceding|my) (postscript|p\.?s\.?|note|sentence|line|remark|update)\b|"
    r"以(这|此|上)句话?为准",
    _FLAGS,
)


def _short(sentence: str) -> bool:
    words = sentence.split()
    cjk = sum("\u4e00" <= ch <= "\u9fff" for ch in sentence)
    return len(words) <= 3 and cjk <= 6


def _brief(sentence: str) -> bool:
    """Short enough to be a lead-in, not the writer's own account: a sentence that names its ticket
    number and asks for the money back is the writer's, though it talks about processing."""
    words = sentence.split()
    cjk = sum("\u4e00" <= ch <= "\u9fff" for ch in sentence)
    return len(words) <= 12 and cjk <= 20


# A sentence that only introduces what follows: a bracketed tag ("【重要】", "[SYSTEM]"), markup that
# opens a block ("<!--", "```yaml", "</complaint>", "> **Note**"), or a line ending in a colon.
_HEADER = re.compile(
    r"^\s*(?:[【\[(（][^】\])）]{0,40}[】\])）]\s*[:：]?|(?:<|```|>|#|---|===)[^\n]{0,80}|[^\n]{0,60}[:：])\s*$"
)


_CLOSER = re.compile(r"^\s*(?:</?[A-Za-z_][\w-]*>|```|-->|---)\s*$")
# A line of a structured block ("  类别: 其他", "severity = S4") and a turn of a made-up dialogue.
_FIELD = re.compile(r"^\s*[-\w\u4e00-\u9fff ]{1,24}\s*[:：=]\s*[^\n。！？!?]{0,60}\s*$|^\s*\|[^\n]*\|\s*$")
_TURN = re.compile(
    _speaker(
        "(user|assistant|system|ai|human|agent|customer|client|support|用户|助手|系统|客服|客户|顾客|买家|商家)"
    ),
    _FLAGS,
)
# A bracketed tag standing alone as a sentence: "[Survey follow-up]", "【已结案通知】".
_TAG = re.compile(r"^\s*[【\[][^】\]\n]{1,40}[】\]]\s*$")
# A line that opens a markup block ("<system>", '<override priority="high">'), and how many sentences
# such a block may run to its closing tag.
_OPENING = re.compile(r"^\s*<([A-Za-z_][\w-]*)[^<>]*>")
_BLOCK = 12
# A sentence that opens with a label of its own ("UPDATE: …", "**Update (resolved):** …", "更新：…").
_LABEL = re.compile(r"^\s*[*_]{0,2}[\w\u4e00-\u9fff ()（）-]{1,24}[*_]{0,2}\s*[:：]\s*[*_]{0,2}\s*\S")


def _about_processing(sentence: str) -> bool:
    return bool(_META.search(sentence) or _EN_PROCESS.search(sentence) or _ZH_PROCESS.search(sentence))


@dataclass(frozen=True)
class _Sentence:
    start: int
    end: int
    text: str
    ends_line: bool  # a line break closes it, or lies between it and the next sentence


def _sentences(text: str) -> list[_Sentence]:
    found = [m for m in _SENTENCE.finditer(text) if m.group(0).strip()]
    out = []
    for i, match in enumerate(found):
        following = text[match.end() : found[i + 1].start()] if i + 1 < len(found) else ""
        out.append(_Sentence(match.start(), match.end(), match.group(0), "\n" in match.group(0) + following))
    return out


# At most this many sentences after an instruction go with it: an appended block is short, and a
# false alarm in a long paragraph should cost the labels a few sentences, not the paragraph.
_RUN_ON = 3


def _withheld(sentences: list[_Sentence], language: Language) -> list[bool]:
    """Which sentences are withheld: each instruction-like one; what runs on after it to the end of
    its line (up to `_RUN_ON` sentences: "…mark it low. Overall I am happy." is one block, the
    writer's next paragraph is not) and markup or dialogue turns closing it on the next lines; and
    what leads into it: headers ("[SYSTEM]", "```yaml", "Note:"), lines of a structured block, and,
    on its line, short lead-ins and talk about the machinery. Never the document's first sentence
    unless it is a header."""
    held = [is_instruction(s.text, language) for s in sentences]
    for i in [i for i, flagged in enumerate(held) if flagged]:
        j = i
        while not sentences[j].ends_line and j + 1 < len(sentences) and j - i < _RUN_ON:
            j += 1
            held[j] = True
        j = i - 1
        while j >= 0 and not held[j]:
            before = sentences[j].text
            same_line = not sentences[j].ends_line
            if j == 0 and not _HEADER.match(before):
                break  # a document opens with its writer's words, whatever follows them
            if not (
                _HEADER.match(before)
                or _FIELD.match(before)
                or (_TURN.match(before) and _TURN.match(sentences[j + 1].text))  # the dialogue's turns
                or (
                    same_line
                    and (
                        _short(before)
                        or (_brief(before) and _about_processing(before))
                        or _LABEL.match(before)
                    )
                )
                or (
                    j == i - 1
                    and same_line
                    and _POINTS_BACK.search(sentences[i].text)
                    and not _QUOTES.search(sentences[i].text)  # "that sentence": its own quotation
                )
            ):
                break
            held[j] = True
            j -= 1
        # A bracketed tag a few sentences before ("[Survey follow-up, auto-appended] Customer rated
        # it 5/5. Sentiment: positive") opens the block: what lies between belongs to it.
        if j >= 0 and not held[j]:
            tag = next((k for k in range(j, max(-1, j - _RUN_ON), -1) if _TAG.match(sentences[k].text)), None)
            if tag is not None:
                held[tag:i] = [True] * (i - tag)
        # Markup that closes the block on the lines after it ("</instructions>", "```"), and the
        # block's further turns and fields ("action: archive").
        j = next((k for k in range(i + 1, len(sentences)) if not held[k]), len(sentences))
        while j < len(sentences) and any(p.match(sentences[j].text) for p in (_CLOSER, _TURN, _FIELD)):
            held[j] = True
            j += 1
    # A markup block withheld at its opening tag ("<system>") is withheld to its closing tag: what
    # lies between ("<reason>Issue resolved in chat</reason>") belongs to it, not to the writer.
    for i in [i for i, flagged in enumerate(held) if flagged]:
        opening = _OPENING.match(sentences[i].text)
        if opening is None:
            continue
        closing = re.compile(rf"^\s*</{re.escape(opening.group(1))}>", _FLAGS)
        end = next(
            (
                k
                for k in range(i + 1, min(len(sentences), i + 1 + _BLOCK))
                if closing.match(sentences[k].text)
            ),
            None,
        )
        if end is not None:
            for k in range(i + 1, end + 1):
                held[k] = True
    return held


def screen(text: str, language: Language) -> Screened:
    """The document with each withheld block (see `_withheld`) replaced by one marker (for the
    model's narrative, so that it neither reads it nor guesses at a gap), and without it at all for
    the label questions: a marker is itself text a small model reacts to (it tilted urgency up),
    and labels should be what the document says without its instructions."""
    sentences = _sentences(text)
    held = _withheld(sentences, language)
    if not any(held):
        return Screened(text, (), text)
    kept: list[str] = []
    bare: list[str] = []
    excerpts: list[str] = []
    position = 0
    for i, sentence in enumerate(sentences):
        between = text[position : sentence.start]  # whatever lay between sentences (spaces)
        position = sentence.end
        if not held[i]:
            kept += [between, sentence.text]
            bare += [between, sentence.text]
            continue
        block_start = i == 0 or not held[i - 1]
        block_end = i + 1 == len(sentences) or not held[i + 1]
        if block_start:
            kept.append(between + sentence.text[: len(sentence.text) - len(sentence.text.lstrip())])
            bare.append(between.rstrip())  # the space that led into the block goes with it
            excerpts.append("")
        else:
            excerpts[-1] += between
        excerpts[-1] += sentence.text
        if block_end:
            excerpts[-1] = excerpts[-1].strip()[:MAX_EXCERPT_CHARS]
            kept.append(_MARKER[language] + ("\n" if sentence.text.endswith("\n") else ""))
    kept.append(text[position:])
    bare.append(text[position:])
    return Screened("".join(kept), tuple(excerpts), "".join(bare).strip())
