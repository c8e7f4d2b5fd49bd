"""The guard's table: a positive whole is turned by a part under the bound and by nothing else."""

from __future__ import annotations

from bench.guard import table


def test_a_part_under_the_bound_turns_a_positive_whole_and_nothing_else_does() -> None:
    results = {
        "injected": [
            {"whole": 1.0, "2": -9.0, "3": -12.0},  # steered: its own part reads clearly negative
            {"whole": 2.0, "2": 2.0, "3": -3.0},  # every part of 2 positive; of 3, one mildly negative
            {"whole": -4.0},  # read negative already: never read in parts
        ],
        "development": [
            {"label": "positive", "whole": 3.0, "2": -7.5, "3": 3.0},
            {"label": "negative", "whole": 0.5, "2": -1.0, "3": -8.5},
        ],
    }
    rows = {(r["parts"], r["bound"]): r for r in table(results)}
    assert rows[(2, -7.0)] == {"parts": 2, "bound": -7.0, "steered_positive": 2, "steered_turned": 1,
                               "dev_positive_turned": 1, "dev_negative_righted": 0}  # fmt: skip
    assert rows[(3, -7.0)]["steered_turned"] == 1 and rows[(3, -7.0)]["dev_negative_righted"] == 1
    assert rows[(3, -2.0)]["steered_turned"] == 2  # the mild one too, at a looser bound
    assert rows[(2, -10.0)]["steered_turned"] == 0 and rows[(2, -10.0)]["dev_positive_turned"] == 0
