"""The paced cost does not move with the machine's speed: a profile that does what `off` does,
on a machine running slower that minute, costs nothing paced, though its tokens/s fell."""

from __future__ import annotations

import pytest

from bench.kv_cost import costs, paced_costs


def run(round_: int, profile: str, speed: float, extra_s: float = 0.0) -> dict[str, float | int | str]:
    """A burst whose weights' products took 10 s at speed 1 and whose other work 5 s, plus `extra_s`."""
    products, steps = 10.0 / speed, 15.0 / speed + extra_s
    rates = {"tok_s": 1000 / steps, "steps_per_product_s": steps / products}
    return {"round": round_, "profile": profile, **rates}


def test_a_slower_minute_costs_nothing_paced_and_added_work_costs_its_share() -> None:
    runs = [run(0, "off", 1.0), run(0, "int4", 0.8), run(1, "int4", 1.0, extra_s=1.5), run(1, "off", 1.0)]
    assert costs(runs, "int4")[0] == pytest.approx(0.2)  # tokens/s saw the machine slow down
    assert paced_costs(runs, "int4") == pytest.approx([0.0, 0.1])  # 1.5 s more over 15 s of steps
