"""The polarity probe's fitting (`bench.probe`): what it learns reads the side, and the folded
weights give what the standardised model gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.probe import cross_validated, depths_for, fit
from pipeline.bundled_models import DEFAULT_MODEL, MODELS
from pipeline.probe import PolarityProbe


def separable(n: int = 80, size: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """States whose third value, offset and scaled unlike the rest, carries the side."""
    g = torch.Generator().manual_seed(seed)
    positive = (torch.arange(n) % 2).double()
    states = torch.randn(n, size, generator=g, dtype=torch.float64) * 5 + 3
    states[:, 2] = 40 + 0.1 * (2 * positive - 1) + 0.01 * torch.randn(n, generator=g, dtype=torch.float64)
    return states, positive


def test_the_fit_reads_the_side_from_the_one_value_that_carries_it() -> None:
    states, positive = separable()
    weights, bias = fit(states, positive, strength=0.1)
    assert int(weights.abs().argmax()) == 2
    assert bool((((states @ weights + bias) > 0) == positive.bool()).all())
    assert cross_validated(states, positive, 0.1) == 1.0


def test_the_folded_weights_on_raw_states_do_not_depend_on_each_value_s_scale_or_offset() -> None:
    # Fitted on standardised states, the raw-state weights give the same log-odds whatever units
    # each value comes in: the standardisation is folded in, not left to the caller.
    states, positive = separable()
    weights, bias = fit(states, positive, strength=1.0)
    scale = torch.linspace(0.1, 10.0, states.shape[1], dtype=torch.float64)
    shift = torch.linspace(-50.0, 50.0, states.shape[1], dtype=torch.float64)
    moved = states * scale + shift
    weights_moved, bias_moved = fit(moved, positive, strength=1.0)
    assert torch.allclose(states @ weights + bias, moved @ weights_moved + bias_moved, atol=1e-4)


# Each bundled model's width and decoder layers (its config.json).
SHAPES = {"qwen2.5-coder-0.5b": (896, 24), "qwen2.5-coder-1.5b": (1536, 28)}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_each_bundled_model_s_probe_file_is_the_one_its_program_describes(name: str) -> None:
    path = MODELS[name].probe_path
    assert path is not None
    probe = PolarityProbe.read(path)
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    assert probe.model == name and set(raw["languages"]) == {"zh", "en"}
    assert raw["provenance"]["program"] == "python -m bench.probe"
    width, layers = SHAPES[name]
    assert probe.hidden_size == width and 1 <= probe.depth <= layers
    assert DEFAULT_MODEL in SHAPES


def test_the_depths_read_sit_at_the_same_fractions_of_any_model_s_layers() -> None:
    assert depths_for(24) == (12, 15, 18, 21)  # the default model's
    assert depths_for(28) == (14, 18, 21, 24)  # the 1.5B model's
    assert depths_for(2) == (1, 2)  # a tiny model: each depth once, none beyond its layers
