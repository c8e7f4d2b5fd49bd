"""The deterministic part of triage: a safety floor no model answer can talk down, and the
escalation rule.

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

from schemas import Language, Triage, Urgency
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
