"""The quality benchmark's arithmetic: reports, the paired subsample, the policy grid (no model)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.quality import document_priors, first_of_each, polarity_report, replay, tune
from bench.quality import questions_by_language as asked_in
from bench.real_data import Labelled
from pipeline.bundled_models import DEFAULT_MODEL, MODELS
from pipeline.labels import LabelPolicy

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def _row(label: str, polarity: str, language: str = "zh") -> dict[str, object]:
    return {"label": label, "polarity": polarity, "language": language, "doubt": False, "expectation": True}


def test_on_binary_labels_a_neutral_answer_is_wrong_and_three_class_data_reports_both_views() -> None:
    binary = polarity_report([_row("positive", "positive"), _row("negative", "neutral")])
    assert binary["accuracy"] == 0.5 and "neutral_recall" not in binary
    assert binary["confusion"]["negative"] == {"positive": 0, "negative": 0, "neutral": 1}
    three = polarity_report(
        [_row("positive", "positive"), _row("negative", "positive"), _row("neutral", "neutral")]
    )
    assert three["accuracy"] == pytest.approx(2 / 3)
    assert three["binary_accuracy"] == 0.5 and three["neutral_recall"] == 1.0
    assert three["macro_f1"] == pytest.approx((2 / 3 + 0 + 1) / 3)


def test_the_paired_subsample_takes_the_first_of_each_source_and_label_in_sample_order() -> None:
    rows = [
        Labelled(s, "en", f"{s}-{p}-{i}", p)
        for s in ("a", "b")
        for p in ("positive", "negative")
        for i in range(3)
    ]
    rows += [Labelled("z", "zh", f"z-{p}-{i}", p) for p in ("positive", "negative") for i in range(5)]
    kept = first_of_each(rows, 4)
    assert [r.text for r in kept if r.language == "en"] == [
        "a-positive-0", "a-positive-1", "a-negative-0", "a-negative-1",
        "b-positive-0", "b-positive-1", "b-negative-0", "b-negative-1",
    ]  # fmt: skip
    assert [r.text for r in kept if r.language == "zh"] == [
        f"z-{p}-{i}" for p in ("positive", "negative") for i in range(4)
    ]


def test_the_grid_replays_stored_scores_and_ranks_policies_by_accuracy() -> None:
    lean = {"polarity": [0.8, 0.2], "attitude": [0.5, 0.5]}  # a model that says "positive" on nothing
    scores = {  # 70:30 positive on a negative document; "no evaluation" at 0.75
        "polarity": [math.log(0.7), math.log(0.3)],
        "attitude": [math.log(0.25), math.log(0.75)],
        "doubt": [0.0, 0.0],
        "expectation": [0.0, 0.0],
    }
    rows = [{**_row("negative", "?"), "scores": scores, "text": "x"}]
    grid = tune(rows, {"zh": lean})
    best = grid[0]
    assert best["all"]["accuracy"] == 1.0
    assert best["polarity_calibration"] >= 1.0 and best["neutral_at"] >= 0.75
    assert grid[-1]["all"]["accuracy"] == 0.0


def test_the_documents_prior_is_the_mean_of_each_language_s_polarity_shares() -> None:
    rows = [
        {"language": "en", "scores": {"polarity": [math.log(0.9), math.log(0.1)]}},
        {"language": "en", "scores": {"polarity": [math.log(0.3), math.log(0.7)]}},
        {"language": "zh", "scores": {"polarity": [math.log(2.0), math.log(2.0)]}},  # shares, not raw
    ]
    assert document_priors(rows) == {
        "en": {"positive": 0.6, "negative": 0.4},
        "zh": {"positive": 0.5, "negative": 0.5},
    }


def test_a_replayed_policy_s_fixed_prior_replaces_the_stored_content_free_one() -> None:
    scores = {"polarity": [math.log(0.7), math.log(0.3)], "attitude": [math.log(0.9), math.log(0.1)],
              "doubt": [0.0, 0.0], "expectation": [0.0, 0.0]}  # fmt: skip
    rows = [{**_row("negative", "?", "en"), "scores": scores}]
    stored = {"en": {"polarity": [0.5, 0.5], "attitude": [0.5, 0.5]}}
    assert replay(rows, asked_in(["en"]), stored, LabelPolicy())[0]["polarity"] == "positive"
    leaning = LabelPolicy(polarity_prior={"en": {"positive": 0.8, "negative": 0.2}})
    assert replay(rows, asked_in(["en"]), stored, leaning)[0]["polarity"] == "negative"


def test_the_default_model_s_prior_is_what_its_committed_development_run_measures() -> None:
    dev = json.loads((RESULTS / "quality-dev-cpu-0.5b-sides.json").read_text(encoding="utf-8"))
    assert dev["split"] == "dev"
    assert MODELS[DEFAULT_MODEL].polarity_prior == document_priors(dev["rows"]["labels"])
