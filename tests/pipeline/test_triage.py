"""Triage rules: urgency by the written criteria (an action asked for: medium, else low); the
safety floor: what a document names about harm or legal action sets the least urgency, and
escalation follows the rule; no model answer can lower either."""

from __future__ import annotations

import pytest

from pipeline.triage import apply_floor, asks_for_action, safety_signals, triage_of
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


@pytest.mark.parametrize(
    ("text", "asks"),
    [
        ("洗衣机漏水，请尽快给我退款。", True),
        ("客服态度太差了，三次都没人回复我，要求给个说法。", True),
        ("I want a refund or a replacement by Friday.", True),
        ("Please call me back about the broken heater.", True),
        ("外卖晚到了半小时，有点失望。", False),
        ("The hotel room was smaller than the photos. Disappointing.", False),
    ],
)
def test_a_complaint_that_asks_for_an_action_is_medium_else_low(text: str, asks: bool) -> None:
    assert asks_for_action(text) is asks
    triage = triage_of(text, Language.ZH, Category.OTHER, None)
    assert triage.urgency is (Urgency.MEDIUM if asks else Urgency.LOW) and not triage.escalate


def test_the_floor_raises_the_rule_and_a_model_s_urgency_replaces_the_rule() -> None:
    burned = "热水器漏电，我母亲被电击送医。请尽快处理。"
    assert triage_of(burned, Language.ZH, Category.SAFETY, None).urgency is Urgency.CRITICAL
    quiet = "The hotel room was smaller than the photos."
    assert (
        triage_of(quiet, Language.EN, Category.OTHER, Urgency.HIGH).urgency is Urgency.HIGH
    )  # URGENCY_FROM=model
    assert triage_of(quiet, Language.EN, Category.OTHER, Urgency.HIGH).escalate
