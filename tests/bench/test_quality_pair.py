"""Two quality runs are compared document by document: discordant counts each way and McNemar's
exact p, which is symmetric and 1 where the runs do not differ."""

from __future__ import annotations

from typing import Any

import pytest

from bench.quality_pair import mcnemar_exact, pair


def _run(polarities: list[str], labels: list[str], doubts: list[bool]) -> dict[str, Any]:
    rows = [
        {"text": f"doc {i}", "label": y, "polarity": p, "doubt": d, "expectation": False}
        for i, (p, y, d) in enumerate(zip(polarities, labels, doubts, strict=True))
    ]
    return {"rows": {"labels": rows}, "as_complaints": {"all": {"accuracy": 0.5}}}


def test_mcnemar_exact_is_the_binomial_tail_doubled_and_symmetric() -> None:
    assert mcnemar_exact(6, 2) == pytest.approx(2 * (1 + 8 + 28) / 256)  # 0.289
    assert mcnemar_exact(2, 6) == mcnemar_exact(6, 2)
    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(3, 3) == 1.0
    assert mcnemar_exact(10, 0) == pytest.approx(2 / 1024)


def test_pairing_counts_each_document_right_in_one_run_only() -> None:
    labels = ["positive", "negative", "positive", "negative"]
    a = _run(["positive", "negative", "negative", "negative"], labels, [True, False, True, False])
    b = _run(["positive", "positive", "positive", "negative"], labels, [True, True, True, False])
    p = pair(a, b)
    assert (p.n, p.accuracy_a, p.accuracy_b) == (4, 0.75, 0.75)
    assert (p.right_only_a, p.right_only_b) == (1, 1)  # doc 1 right in a only, doc 2 in b only
    assert p.agree_polarity == 0.5 and p.agree_doubt == 0.75 and p.agree_expectation == 1.0
    assert p.as_complaints_a == 0.5


def test_runs_on_different_documents_are_refused() -> None:
    a = _run(["positive"], ["positive"], [False])
    b = _run(["positive"], ["positive"], [False])
    b["rows"]["labels"][0]["text"] = "another"
    with pytest.raises(ValueError, match="different documents"):
        pair(a, b)
