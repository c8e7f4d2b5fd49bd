"""How the model's probabilities for the allowed answers become labels: the policy (calibration,
neutral threshold, probe, parts), the calibrated option probabilities, and the decision. Pure
functions of stored scores, so that `bench.quality --replay` decides again without a model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pipeline.probe import PolarityProbe
from prompts import Question
from prompts.render import POLARITY_QUESTIONS
from schemas import Category, Polarity, Urgency


@dataclass(frozen=True)
class Labels:
    """The decided labels and the probabilities they were decided with."""

    polarity: Polarity
    confidence: float
    doubt: bool
    expectation: bool
    category: Category | None
    urgency: Urgency | None
    # The queue question's calibrated probability per queue (by value), where it was asked: the
    # triage picks among the queues a complaint's words name by these (`pipeline.triage.queue_of`).
    category_shares: Mapping[str, float] | None = None


@dataclass(frozen=True)
class Scored:
    """A document's labelling questions, the model's log-probability for each allowed answer, and
    each calibrated question's option probabilities on content-free inputs."""

    asked: dict[str, Question]
    logprobs: dict[str, list[float]]
    priors: dict[str, list[float]]
    probe: float | None = None  # the polarity probe's log-odds of positive, where the policy has one
    # (a policy without a probe decides from the questions, even where a reading is stored)


@dataclass(frozen=True)
class LabelPolicy:
    """How option probabilities become labels. The defaults were chosen on development data only
    (`python -m bench.quality --split dev`, then `--tune`; see README "Quality, measured")."""

    neutral_at: float = 0.9  # neutral when P(no evaluation), calibrated, exceeds this
    polarity_calibration: float = 1.0  # share of the content-free prior divided out (0: none)
    # The side questions asked and combined (their calibrated log-odds averaged); see
    # `prompts.render.POLARITY_QUESTIONS`. Those not named here are not asked.
    polarity_questions: tuple[str, ...] = ("polarity",)
    # Per language ("zh", "en"): the polarity question's option probabilities averaged over a
    # development split's documents (batch calibration, Zhou et al. 2023), by value. Where given it
    # replaces the prior measured on content-free inputs; a bundled model carries its own
    # (`pipeline.bundled_models`), another model's comes from `python -m bench.quality --tune`.
    polarity_prior: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    # Complaints' urgency: "rules" (the written criteria, `pipeline.triage.triage_of`; the urgency
    # question is not asked) or "model" (its answer, then the same floor). URGENCY_FROM.
    urgency_from: Literal["rules", "model"] = "rules"
    # Where given, polarity's side is read from the model's hidden state by this probe (`pipeline.
    # probe`; a bundled model carries its own) instead of the side questions.
    probe: PolarityProbe | None = None
    # With a probe: how many contiguous parts of the document it reads (at sentence ends), the
    # decision being their length-weighted mean log-odds (`pipeline.probe.parts`); 1: the whole.
    polarity_parts: int = 1
    # With a probe, for a triaged kind (complaints): a positive reading is checked against this many
    # contiguous parts read apart, and a part that reads clearly negative (log-odds under
    # `guard_below`) decides (`pipeline.probe.guarded`); 1: no check. A complaint is called positive
    # only where no part of it reads clearly negative. Both chosen on the development split and the
    # development injection sets (README "Injection"): 3 parts and -7 kept 15 of 16 steered
    # complaints negative and turned 2 of 262 positive or negative documents read as complaints.
    guard_parts: int = 3
    guard_below: float = -7.0

    def fixed_prior(self, language: str, question: Question) -> list[float] | None:
        """`question`'s prior in option order when the policy fixes it for `language`, else None."""
        measured = self.polarity_prior.get(language) if question.name == "polarity" else None
        return None if measured is None else [measured[v] for v in question.values]


def probabilities(
    logprobs: Sequence[float], prior: Sequence[float] | None, weight: float = 1.0
) -> list[float]:
    """Each option's probability among the options, after dividing out `prior` (the model's
    preference without content) to the power `weight`, when given."""
    scores = list(logprobs)
    if prior is not None:
        scores = [s - weight * math.log(max(p, 1e-9)) for s, p in zip(scores, prior, strict=True)]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    return [w / total for w in weights]


def choose(
    question: Question, logprobs: Sequence[float], prior: Sequence[float] | None, weight: float = 1.0
) -> tuple[str, float]:
    """The value whose option the model finds most likely, and its probability (`probabilities`)."""
    shares = probabilities(logprobs, prior, weight)
    best = max(range(len(shares)), key=shares.__getitem__)
    return question.values[best], shares[best]


def combined_side(scored: Scored, policy: LabelPolicy) -> tuple[str, float]:
    """Positive or negative, and its probability: the probe's reading where there is one, else each
    named side question's calibrated log-odds of positive against negative, averaged (one
    question: exactly `choose`)."""
    if policy.probe is not None and scored.probe is not None:
        return _side(1 / (1 + math.exp(-max(-50.0, min(50.0, scored.probe)))))
    if not policy.polarity_questions:
        raise ValueError("a label policy without a probe asks at least one side question")
    odds = []
    for name in policy.polarity_questions:
        question = scored.asked[name]
        shares = probabilities(scored.logprobs[name], scored.priors.get(name), policy.polarity_calibration)
        positive = shares[question.values.index(Polarity.POSITIVE.value)]
        odds.append(math.log(max(positive, 1e-12)) - math.log(max(1 - positive, 1e-12)))
    mean = sum(odds) / len(odds)
    return _side(1 / (1 + math.exp(-mean)))


def _side(p_positive: float) -> tuple[str, float]:
    if p_positive >= 0.5:
        return Polarity.POSITIVE.value, p_positive
    return Polarity.NEGATIVE.value, 1 - p_positive


def decide(scored: Scored, policy: LabelPolicy) -> Labels:
    """The labels of scored questions: polarity from its two sides unless the attitude question
    finds no evaluation (neutral, with that probability as the confidence)."""
    asked, logprobs, priors = scored.asked, scored.logprobs, scored.priors
    side, confidence = combined_side(scored, policy)
    attitude = probabilities(logprobs["attitude"], priors.get("attitude"))
    p_none = attitude[asked["attitude"].values.index("false")]
    polarity = Polarity(side)
    if p_none > policy.neutral_at:
        polarity, confidence = Polarity.NEUTRAL, p_none
    pick = {
        name: choose(asked[name], logprobs[name], priors.get(name))[0]
        for name in asked
        if name not in (*POLARITY_QUESTIONS, "attitude")
    }
    return Labels(
        polarity,
        round(confidence, 4),
        pick["doubt"] == "true",
        pick["expectation"] == "true",
        Category(pick["category"]) if "category" in pick else None,
        Urgency(pick["urgency"]) if "urgency" in pick else None,
        category_shares(asked, logprobs, priors),
    )


def category_shares(
    asked: Mapping[str, Question], logprobs: Mapping[str, Sequence[float]], priors: Mapping[str, list[float]]
) -> dict[str, float] | None:
    """The queue question's calibrated probabilities by queue value; None where it was not asked."""
    if "category" not in asked:
        return None
    question = asked["category"]
    shares = probabilities(logprobs["category"], priors.get("category"))
    return {value: round(share, 6) for value, share in zip(question.values, shares, strict=True)}
