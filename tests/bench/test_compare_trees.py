"""A variant named per checkout (`before:after`) runs under each checkout's own name; one name runs
in both."""

from __future__ import annotations

from bench.compare_trees import named_in


def test_a_pair_names_the_variant_in_each_checkout() -> None:
    pair = "engine_dynamic:engine_dynamic_unpacked"
    assert named_in(pair, "before") == "engine_dynamic"
    assert named_in(pair, "again") == "engine_dynamic"  # the noise run repeats the old checkout
    assert named_in(pair, "after") == "engine_dynamic_unpacked"


def test_one_name_runs_in_both_checkouts() -> None:
    assert {named_in("engine_dynamic_int8", tree) for tree in ("before", "after")} == {"engine_dynamic_int8"}
