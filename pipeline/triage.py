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
including any sentence withheld from the model as instruction-like.
"""

from __future__ import annotations

import re
from typing import NamedTuple

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


# The writer asks for an action: a refund, a repair, a replacement, compensation or an answer.
_ASKS_ZH = re.compile(r"退款|退钱|退货|换货|更换|换一台|换新|维修|修理|修好|赔偿|补偿|回复|答复|回电|给.{0,4}说法|要求"
                      r"|请.{0,8}(退|换|修|赔|回|处理|解决)")  # fmt: skip
_ASKS_EN = _en(r"\b(refund|money back|replace|replacement|repair|fix|compensat|reimburs|respond|reply|call me back"
               r"|get back to me|an answer|resolve|return (it|the))")  # fmt: skip


def asks_for_action(text: str) -> bool:
    """Whether the text asks for a refund, repair, replacement, compensation or an answer (either
    language's words, as with the safety signals)."""
    return bool(_ASKS_ZH.search(text) or _ASKS_EN.search(text))


def triage_of(text: str, language: Language, category: Category, model_urgency: Urgency | None) -> Triage:
    """A complaint's triage: urgency from the model when it answered (URGENCY_FROM=model), else by
    the rule (medium when it asks for an action, else low); then the safety floor and escalation."""
    urgency = model_urgency or (Urgency.MEDIUM if asks_for_action(text) else Urgency.LOW)
    draft = Triage(urgency=urgency, category=category, escalate=False)
    return apply_floor(draft, safety_signals(text, language))


def safety_signals(text: str, language: Language) -> list[Signal]:
    """The signals the text names, in the order above. Both languages' patterns apply: a Chinese
    complaint may quote an English term and the other way round."""
    del language  # kept in the signature: the tables are per language, the check reads both
    return [s for s in SIGNALS if s.zh.search(text) or s.en.search(text)]


def at_least(urgency: Urgency, floor: Urgency) -> Urgency:
    return urgency if _ORDER.index(urgency) >= _ORDER.index(floor) else floor


def apply_floor(triage: Triage, signals: list[Signal]) -> Triage:
    """The triage with urgency raised to every signal's floor and escalation by the rule."""
    urgency = triage.urgency
    for signal in signals:
        urgency = at_least(urgency, signal.floor)
    return triage.model_copy(
        update={
            "urgency": urgency,
            "escalate": urgency.value in ESCALATE_AT,
            "safety_signals": [s.code for s in signals],
        }
    )
