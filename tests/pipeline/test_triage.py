"""The safety floor: what a document names about harm or legal action sets the least urgency, and
escalation follows the rule; no model answer can lower either."""

from __future__ import annotations

import pytest

from pipeline.triage import apply_floor, safety_signals
from schemas import Category, Language, Triage, Urgency
from schemas.taxonomy import ESCALATE_AT

LOW = Triage(urgency=Urgency.LOW, category=Category.PRODUCT_QUALITY, escalate=False)


@pytest.mark.parametrize(
    ("text", "language", "signal", "floor"),
    [
        ("热水器漏电，我母亲触电了。", Language.ZH, "electric_shock", Urgency.CRITICAL),
        ("孩子被烫伤，现在在医院。", Language.ZH, "hospital", Urgency.CRITICAL),
        ("充电宝在床头起火了。", Language.ZH, "fire", Urgency.CRITICAL),
        ("我已经请了律师，准备起诉你们。", Language.ZH, "legal_action", Urgency.HIGH),
        ("我会向市场监管局和12315投诉。", Language.ZH, "regulator", Urgency.HIGH),
        (
            "My son was burned by the kettle and is in the emergency room.",
            Language.EN,
            "injury",
            Urgency.CRITICAL,
        ),
        ("The dryer caught fire in our garage.", Language.EN, "fire", Urgency.CRITICAL),
        ("My father died after taking the pills you sold.", Language.EN, "death", Urgency.CRITICAL),
        ("I have filed a complaint with the CFPB.", Language.EN, "regulator", Urgency.HIGH),
        ("My lawyer will be in touch; we intend to sue.", Language.EN, "legal_action", Urgency.HIGH),
    ],
)
def test_named_harm_or_legal_action_raises_urgency_and_escalates(
    text: str, language: Language, signal: str, floor: Urgency
) -> None:
    signals = safety_signals(text, language)
    assert signal in [s.code for s in signals]
    floored = apply_floor(LOW, signals)
    assert floored.urgency is floor and floored.escalate and signal in floored.safety_signals


def test_without_signals_the_answer_stands_and_escalation_follows_the_rule() -> None:
    text = "The parcel arrived two days late."
    assert safety_signals(text, Language.EN) == []
    for urgency in Urgency:
        answer = Triage(urgency=urgency, category=Category.DELIVERY, escalate=urgency is Urgency.LOW)
        floored = apply_floor(answer, [])
        assert floored.urgency is urgency and floored.escalate == (urgency.value in ESCALATE_AT)


def test_the_floor_never_lowers_an_answer() -> None:
    critical = Triage(urgency=Urgency.CRITICAL, category=Category.SAFETY, escalate=True)
    floored = apply_floor(critical, safety_signals("I will sue.", Language.EN))
    assert floored.urgency is Urgency.CRITICAL and floored.escalate
