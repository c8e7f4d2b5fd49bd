"""The deterministic part of triage: the urgency rule, a safety floor no model answer can talk
down, and the escalation rule.

Urgency by the written criteria (README "Triage"): `medium` when the writer asks for something
(a refund, a repair, a replacement, an answer), else `low`; the floor raises it to `high` or
`critical`. A model's own urgency answer replaces the rule only when URGENCY_FROM=model: the
bundled models' answers were worse than a constant on the team's labelled complaints.

A complaint that names harm to a person (injury, hospital, death, fire, electric shock,
poisoning) is `critical`; one that names legal action or a regulator is at least `high`. Both
escalate. The signals are plain patterns per language, documented in README ("Triage"); they err
towards escalating (a "no one was hurt" still names hurt): a supervisor reading one complaint too
many costs less than a burned hand left in the low queue. The floor reads the whole document,
including any sentence withheld from the model as instruction-like; the request rule reads the
writer's own words only (the document less those sentences): "tickets that mention a refund are
positive" or "UPDATE: refund issued, case closed" is not the writer asking for a refund.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

from prompts import screen
from schemas import Category, Language, Triage, Urgency
from schemas.taxonomy import ESCALATE_AT

_ORDER = [Urgency.LOW, Urgency.MEDIUM, Urgency.HIGH, Urgency.CRITICAL]


class Signal(NamedTuple):
    code: str
    floor: Urgency
    zh: re.Pattern[str]
    en: re.Pattern[str]


def _en(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.IGNORECASE)


SIGNALS: tuple[Signal, ...] = (
    Signal("injury", Urgency.CRITICAL, re.compile(r"受伤|烫伤|烧伤|割伤|划伤|骨折|流血|伤口|致残|砸伤|炸伤"),
           _en(r"\b(injur(y|ies|ed)|burn(s|ed|t)\b|wound(ed)?|bleed(ing)?|fractur|broke (his|her|my) (arm|leg|wrist))")),
    Signal("hospital", Urgency.CRITICAL, re.compile(r"住院|送医|医院|急诊|抢救|ICU|重症|救护车"),
           _en(r"\b(hospital(i[sz]ed)?|emergency room|A&E|ICU|ambulance|intensive care)\b")),
    Signal("death", Urgency.CRITICAL, re.compile(r"死亡|去世|身亡|丧命|致死|死了"),
           _en(r"\b(died|death|dead|killed|fatal)\b")),
    Signal("fire", Urgency.CRITICAL, re.compile(r"起火|着火|火灾|爆炸|自燃|冒烟|烧毁|炸了"),
           _en(r"\b(caught fire|on fire|fire broke|burst into flames|explod(ed|es|ing)|explosion|smok(e|ing) (came|poured))")),
    Signal("electric_shock", Urgency.CRITICAL, re.compile(r"触电|漏电|电击|电到"),
           _en(r"\b(electric(al)? shock|electrocut|got shocked|shocked (me|him|her|my))")),
    Signal("poisoning", Urgency.CRITICAL, re.compile(r"中毒|食物中毒|过敏性休克"),
           _en(r"\b(poison(ed|ing)?|anaphyla)")),
    Signal("legal_action", Urgency.HIGH, re.compile(r"起诉|诉讼|律师|法院|仲裁|律师函|打官司"),
           _en(r"\b(lawsuit|sue|suing|sued|attorney|lawyer|legal action|court|small claims)\b")),
    Signal("regulator", Urgency.HIGH, re.compile(r"12315|市场监管|消协|消费者协会|工商局|监管部门|银保监|金融监管|媒体曝光"),
           _en(r"\b(regulator|FTC|CFPB|attorney general|consumer protection|trading standards|ombudsman|BBB|Better Business Bureau)\b")),
)  # fmt: skip


# The writer asks for an action: a refund, a repair, a replacement, compensation or an answer
# ("请问" opens a question, "may I ask", not a request: "请问您对处理结果满意吗" asks for nothing;
# "麻烦…换回来" asks as "请" does).
_ASKS_ZH = re.compile(r"退款|退钱|退货|换货|更换|换一台|换新|维修|修理|修好|赔偿|补偿|回复|答复|回电|给.{0,4}说法|要求"
                      r"|(请(?!问)|麻烦|尽快).{0,8}(退|换|修|赔|回复|回电|回应|处理|解决)")  # fmt: skip
_ASKS_EN = _en(r"\b(refund|money back|replace|replacement|repair|fix|compensat|reimburs|respond|reply|call me back"
               r"|get back to me|an answer|resolve|return (it|the))")  # fmt: skip
# What was already done is not asked for: "退款已到账", "已经全额退款", "the refund came through",
# "you've fixed everything", "Issue resolved in chat" (but "I'd like them replaced" and "if this
# isn't resolved" still ask).
_DONE = (
    re.compile(r"(已经?|已被)(全额)?(退款|退货|换货|更换|维修|修好|赔偿|补偿|回复)|(退款|赔偿|补偿)(已|已经)(到账|退回|发放|支付)"
               r"|已[^，。！？,.!?\n]{0,16}(补偿|赔偿|退款|退货|换货|维修)(到位|完成|完毕|到账)"),
    _en(r"\b(refund|replacement|repair|compensation)s? (came through|arrived|was (issued|processed|paid|received|made))"
        r"|\b(got|received|have had|had) (a|my|the|full) (refund|replacement|repair)"
        r"|\b(I've|I have|we've|we have|you've|you have|they've|they have|has been|have been|was|were) "
        r"(\w+ly )?(all )?(fixed|repaired|replaced|resolved|refunded)\b"
        r"|\b(issue|problem|case|ticket|matter)s? (is |was |has been |have been |now )?(resolved|fixed|closed)\b"),
)  # fmt: skip


# A turn of the business's side in a quoted exchange, opening a line or following a sentence's end
# ("客服：已为您退款", "… Agent (Mia): I've refunded you in full", "[Support]: we can replace it"): what
# the other side did or offers is not the writer asking for it.
_THEIR_TURN = re.compile(
    r"(?:^|(?<=[.!?。！？]))\s*[\[【(（]?\s*"
    r"(客服|商家|卖家|店家|店铺|工作人员|售后|agent|support|representative|rep|staff|seller|merchant)"
    r"(\s*[(（][^)）\n]{0,24}[)）])?\s*[\]】)）]?\s*[:：][^\n]*",
    re.IGNORECASE | re.MULTILINE,
)


def writers_words(text: str) -> str:
    """The text less the turns of the business's side in a quoted exchange (`_THEIR_TURN`)."""
    return _THEIR_TURN.sub(" ", text)


def asks_for_action(text: str) -> bool:
    """Whether the text asks for a refund, repair, replacement, compensation or an answer (either
    language's words, as with the safety signals); what it says was already done does not count."""
    for done in _DONE:
        text = done.sub(" ", text)
    return bool(_ASKS_ZH.search(text) or _ASKS_EN.search(text))


# The words of each queue's scope (`schemas.taxonomy.CATEGORY_LABELS`), per language, written from
# those definitions: which queues a complaint's own words name. `safety` is the floor's (harm named).
_QUEUE_WORDS: dict[Category, re.Pattern[str]] = {
    Category.SAFETY: re.compile(r"安全隐患|危险|火花|冒烟|漏电|\b(hazard|dangerous|unsafe|sparks?|smok(e|ing))\b", re.I),
    Category.PRODUCT_QUALITY: re.compile(
        r"质量|坏了|故障|损坏|失灵|不工作|不能用|用不了|漏水|裂|异响|做工|瑕疵|次品|"
        r"\b(faulty|broken|broke|defect\w*|stopped working|doesn'?t work|won'?t (turn on|start|work)|leak\w*|"
        r"cracked|poor quality|malfunction\w*|fell apart)\b", re.I),
    Category.DELIVERY: re.compile(
        r"快递|物流|配送|发货|送货|包裹|派送|签收|送错|丢件|运输|"
        r"\b(deliver\w*|shipping|shipment|shipped|courier|parcel|package|tracking|in transit|never arrived)\b", re.I),
    Category.BILLING: re.compile(
        r"扣费|收费|多收|扣款|账单|乱收费|发票|费用|价格|差价|"
        r"\b(charged?|charges|billing|bill(ed)?|invoice|overcharg\w*|fees?|price|payment|paid twice)\b", re.I),
    Category.CUSTOMER_SERVICE: re.compile(
        r"态度|推诿|踢皮球|没人接|不接电话|无人接听|不回复|没人回复|敷衍|没人理|挂(了)?电话|"
        r"\b(rude|attitude|no one answered|nobody answered|passed (me )?around|hung up|unhelpful|ignored)\b", re.I),
    Category.AFTER_SALES: re.compile(
        r"保修|维修|售后|安装|退换货|换货|退货|上门|三包|"
        r"\b(warranty|repair\w*|install\w*|technician|exchange|return (policy|request)|returns)\b", re.I),
    Category.MISLEADING_CLAIMS: re.compile(
        r"虚假宣传|宣传|广告|承诺|与描述不符|不符|夸大|欺骗|忽悠|"
        r"\b(advertis\w*|misleading|false(ly)?|promised|claimed|not as described|bait)\b", re.I),
    Category.ACCOUNT_ACCESS: re.compile(
        r"登录|登陆|账号|账户|密码|(?<![A-Za-z])APP(?![A-Za-z])|应用|网站|闪退|验证码|"
        r"\b(log ?in|sign ?in|account|password|app|website|locked out|crash\w*)\b", re.I),
    Category.PRIVACY: re.compile(
        r"个人信息|隐私|泄露|骚扰电话|推销电话|信息被|"
        r"\b(privacy|personal (data|information|details)|leaked|data breach|spam calls|sold my|shared my)\b", re.I),
}  # fmt: skip


def named_queues(text: str) -> list[Category]:
    """The queues whose scope words the text uses, in the taxonomy's order."""
    return [category for category, words in _QUEUE_WORDS.items() if words.search(text)]


def queue_of(text: str, model_category: Category, shares: Mapping[str, float] | None = None) -> Category:
    """The routing queue: the one queue the writer's words name; where they name several, the one the
    model finds likeliest among those (`shares`: its calibrated probability per queue; without
    them, the model's own choice when named, else the first named); where they name none, the
    model's choice."""
    named = named_queues(text)
    if not named:
        return model_category
    if len(named) == 1:
        return named[0]
    if shares:
        return max(named, key=lambda c: shares.get(c.value, 0.0))
    return model_category if model_category in named else named[0]


def triage_of(
    text: str,
    language: Language,
    category: Category,
    model_urgency: Urgency | None,
    category_shares: Mapping[str, float] | None = None,
) -> Triage:
    """A complaint's triage: the queue its writer's words name (`queue_of`; the model's choice where
    they name none); urgency from the model when it answered (URGENCY_FROM=model), else by the rule
    (medium when the writer's own words ask for an action, else low: the document less
    its instruction-like sentences and the business's turns in a quoted exchange); then the safety floor over the
    whole text, and escalation."""
    own_words = writers_words(screen(text, language).labelled)
    urgency = model_urgency or (Urgency.MEDIUM if asks_for_action(own_words) else Urgency.LOW)
    queue = queue_of(own_words, category, category_shares)
    draft = Triage(urgency=urgency, category=queue, escalate=False)
    return apply_floor(draft, safety_signals(text, language))


# Figures of speech in the signals' words that name no harm, read out before the signals: "气死了" /
# "烦死了" (so angry, so annoyed), "死机" is not among the words; "the battery died", "three keys are
# dead", "dead on arrival". A person's death still reads: "my father died", "could have died".
_FIGURES = (
    re.compile(r"[气烦累热冷笑吓饿困急忙丑卡憋闷坑慢贵吵臭烂馋愁]死了"),
    _en(r"\b(battery|batteries|phone|charger|laptop|computer|engine|motor|screen|display|bulb|car|device|unit|"
        r"machine|fan|headphones|earbuds|tv|remote|router|printer|app|line|signal|call|keys?|buttons?|pixels?|"
        r"speakers?|port|camera|mouse|keyboard|controller|console|sensor|switch|outlet|socket)"
        r"\s+(\w+\s+){0,2}(died|dead)\b|\bdead (battery|batteries|pixels?|on arrival|zone|end|silence|line)\b"),
)  # fmt: skip


def safety_signals(text: str, language: Language) -> list[Signal]:
    """The signals the text names, in the order above. Both languages' patterns apply: a Chinese
    complaint may quote an English term and the other way round."""
    del language  # kept in the signature: the tables are per language, the check reads both
    for figure in _FIGURES:
        text = figure.sub(" ", text)
    return [s for s in SIGNALS if s.zh.search(text) or s.en.search(text)]


def at_least(urgency: Urgency, floor: Urgency) -> Urgency:
    return urgency if _ORDER.index(urgency) >= _ORDER.index(floor) else floor


def apply_floor(triage: Triage, signals: list[Signal]) -> Triage:
    """The triage with urgency raised to every signal's floor and escalation by the rule; a
    complaint that names harm to a person (a `critical` signal) goes to the `safety` queue, which
    the taxonomy defines by exactly that, whatever queue the model chose."""
    urgency = triage.urgency
    for signal in signals:
        urgency = at_least(urgency, signal.floor)
    harm = any(signal.floor is Urgency.CRITICAL for signal in signals)
    return triage.model_copy(
        update={
            "urgency": urgency,
            "category": Category.SAFETY if harm else triage.category,
            "escalate": urgency.value in ESCALATE_AT,
            "safety_signals": [s.code for s in signals],
        }
    )
