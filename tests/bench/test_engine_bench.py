"""The engine benchmark's plan of repeated runs and how it picks medians (no model needed), and
its variants run one after another on one model."""

from __future__ import annotations

from bench.engine_bench import median_run, schedule
from bench.engine_variants import Run, engine_run, hf_generate_batch
from engine.tiny import build_tiny


def _run(variant: str, tok_s: float, round_: int = 0) -> Run:
    return Run(variant, "burst", 10.0, int(tok_s * 10), [1.0], [0.1], 0.0, round=round_)


def test_every_variant_runs_once_and_only_the_headline_pair_repeats_in_alternating_order() -> None:
    plan = schedule(["hf_generate_1", "hf_generate_batch", "engine_dynamic"], ["burst", "stream"], 3)
    first = [(v, s) for r, v, s in plan if r == 0]
    assert first == [
        ("hf_generate_1", "burst"),
        ("hf_generate_batch", "burst"),
        ("engine_dynamic", "burst"),
        ("hf_generate_1", "stream"),
        ("engine_dynamic", "stream"),
    ]
    # each further round: the two headline runs, back to back, in reverse order every other round
    assert [(v, s) for r, v, s in plan if r == 1] == [("engine_dynamic", "burst"), ("hf_generate_1", "burst")]
    assert [(v, s) for r, v, s in plan if r == 2] == [("hf_generate_1", "burst"), ("engine_dynamic", "burst")]
    assert schedule(["engine_dynamic"], ["stream"], 3) == [(0, "engine_dynamic", "stream")]


def test_the_median_run_is_the_middle_one_by_tokens_per_second() -> None:
    runs = [_run("engine_dynamic", t, i) for i, t in enumerate((80.0, 70.0, 90.0))]
    assert median_run(runs).round == 0
    assert median_run(runs[:2]).round == 1  # an even count: the lower middle one


def test_transformers_batch_generation_runs_after_the_engine_on_the_same_model() -> None:
    """The engine leaves its own attention function on the model; generate_batch refuses it unless
    the variant sets its own (the GPU run's order: the engine's warm-up, then generate_batch)."""
    tiny = build_tiny()
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    ours = engine_run(tiny, prompts, 3, [0.0, 0.0], True, 2, 16, kv_cache_bytes=1 << 20)
    theirs = hf_generate_batch(tiny, prompts, 3)
    assert ours.tokens == theirs.tokens == 6
