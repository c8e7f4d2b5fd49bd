"""Labels from scored answers: calibrated choice, neutral's threshold, side questions combined,
the queue's probabilities, fixed priors (pure functions of stored scores)."""

from __future__ import annotations

import math

import pytest

from pipeline.labels import LabelPolicy, Scored, choose, decide
from prompts import questions
from schemas import BUILT_IN_KINDS, DocumentKind, Language, Polarity


def test_choice_takes_the_likeliest_option_and_calibration_divides_out_the_bias() -> None:
    polarity = questions(BUILT_IN_KINDS[DocumentKind.FILING], Language.EN, "x")[0]
    assert polarity.values == ("positive", "negative")
    # The model says "positive" 60:40 here, but 80:20 on content-free inputs: a lean to negative.
    logprobs = [math.log(0.6), math.log(0.4)]
    assert choose(polarity, logprobs, None) == ("positive", pytest.approx(0.6))
    value, p = choose(polarity, logprobs, [0.8, 0.2])
    assert value == "negative" and p == pytest.approx((0.4 / 0.2) / (0.6 / 0.8 + 0.4 / 0.2))


def test_the_policy_sets_how_narrow_neutral_is_and_how_much_of_the_prior_is_divided_out() -> None:
    asked = {q.name: q for q in questions(BUILT_IN_KINDS[DocumentKind.FILING], Language.EN, "x")}
    # The model leans 60:40 positive here and 80:20 on content-free inputs; "no evaluation" 0.7.
    logprobs = {
        "polarity": [math.log(0.6), math.log(0.4)],
        "attitude": [math.log(0.3), math.log(0.7)],
        "doubt": [0.0, -1.0],
        "expectation": [-1.0, 0.0],
    }
    scored = Scored(asked, logprobs, {"polarity": [0.8, 0.2], "attitude": [0.5, 0.5]})
    assert decide(scored, LabelPolicy(neutral_at=0.5)).polarity is Polarity.NEUTRAL
    narrow = decide(scored, LabelPolicy(neutral_at=0.9))
    assert narrow.polarity is Polarity.NEGATIVE  # calibrated, the lean reverses
    assert narrow.doubt and not narrow.expectation
    raw = decide(scored, LabelPolicy(neutral_at=0.9, polarity_calibration=0.0))
    assert raw.polarity is Polarity.POSITIVE and raw.confidence == pytest.approx(0.6)
    half = decide(scored, LabelPolicy(neutral_at=0.9, polarity_calibration=0.5))
    assert half.polarity is Polarity.NEGATIVE  # 0.6/0.8**0.5 < 0.4/0.2**0.5
    assert decide(scored, LabelPolicy(neutral_at=1.0)).polarity is not Polarity.NEUTRAL


def test_the_queue_s_probabilities_are_calibrated_and_its_choice_is_their_likeliest() -> None:
    asked = {q.name: q for q in questions(BUILT_IN_KINDS[DocumentKind.COMPLAINT], Language.EN, "x")}
    queues = asked["category"].values
    logprobs = {name: [math.log(1 / len(q.values))] * len(q.values) for name, q in asked.items()}
    logprobs["category"] = [math.log(0.3 if v == "billing" else 0.7 / (len(queues) - 1)) for v in queues]
    prior = [0.5 if v == "billing" else 0.5 / (len(queues) - 1) for v in queues]  # billing is its habit
    labels = decide(Scored(asked, logprobs, {"category": prior}), LabelPolicy())
    shares = labels.category_shares
    assert shares is not None and sum(shares.values()) == pytest.approx(1.0, abs=1e-4)
    assert labels.category is not None and shares[labels.category.value] == max(shares.values())
    assert labels.category.value != "billing" and shares["billing"] < 0.3  # divided out
    filing = {q.name: q for q in questions(BUILT_IN_KINDS[DocumentKind.FILING], Language.EN, "x")}
    plain = {name: [0.0] * len(q.values) for name, q in filing.items()}
    assert decide(Scored(filing, plain, {}), LabelPolicy()).category_shares is None


def test_side_questions_are_combined_by_their_calibrated_log_odds() -> None:
    asked = {q.name: q for q in questions(BUILT_IN_KINDS[DocumentKind.FILING], Language.EN, "x")}
    logprobs = {
        "polarity": [math.log(0.6), math.log(0.4)],  # positive, mildly
        "outcome": [math.log(0.1), math.log(0.9)],  # bad, firmly
        "attitude": [0.0, -5.0],
        "doubt": [0.0, -1.0],
        "expectation": [-1.0, 0.0],
    }
    scored = Scored(asked, logprobs, {})
    one = decide(scored, LabelPolicy(polarity_questions=("polarity",)))
    assert one.polarity is Polarity.POSITIVE and one.confidence == pytest.approx(0.6, abs=1e-4)
    both = decide(scored, LabelPolicy(polarity_questions=("polarity", "outcome")))
    mean = (math.log(0.6 / 0.4) + math.log(0.1 / 0.9)) / 2
    assert both.polarity is Polarity.NEGATIVE and both.confidence == pytest.approx(
        1 / (1 + math.exp(mean)), abs=1e-4
    )


def test_a_fixed_polarity_prior_is_read_by_value_for_its_language_only() -> None:
    asked = {q.name: q for q in questions(BUILT_IN_KINDS[DocumentKind.FILING], Language.EN, "x")}
    policy = LabelPolicy(polarity_prior={"en": {"negative": 0.3, "positive": 0.7}})
    assert policy.fixed_prior("en", asked["polarity"]) == [0.7, 0.3]  # in the question's option order
    assert policy.fixed_prior("zh", asked["polarity"]) is None
    assert policy.fixed_prior("en", asked["attitude"]) is None
