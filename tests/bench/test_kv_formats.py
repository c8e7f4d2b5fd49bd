"""The search's named formats stand for the engine's profiles: the mixed profile holds the bytes
the engine's store holds for the same layers, and every named format is one the search can run."""

from __future__ import annotations

import json

import pytest
import torch

from bench.kv_fake import bytes_ratio
from bench.kv_formats import FORMATS, MIXED, SENSITIVE, settings
from engine.kv_cache import ColdStore, KVShape
from engine.kv_quant import layer_formats


def test_the_mixed_format_holds_the_bytes_of_the_engine_s_mixed_profile() -> None:
    """KV_QUANT_BITS=4 KV_INT8_LAYERS=SENSITIVE in the engine; the default model's shape."""
    shape = KVShape(num_layers=24, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    block = ColdStore.bytes_per_block(shape, layer_formats(24, 4, SENSITIVE), 16)
    engine = block / 16 / shape.bytes_per_token
    assert bytes_ratio(MIXED, 24, 64) == pytest.approx(engine)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_named_format_has_bytes_between_none_and_full_precision(name: str) -> None:
    ratio = bytes_ratio(FORMATS[name], 24, 64, kv_heads=2)  # the default model's shape
    assert 0 < ratio <= 1
    assert (ratio == 1) == (not FORMATS[name].quantise)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_named_format_s_settings_are_written_as_json(name: str) -> None:
    written = json.loads(json.dumps(settings(FORMATS[name])))
    assert written["keys_per_token"] == FORMATS[name].keys_per_token
    assert len(written["head_bits"]) == len(FORMATS[name].head_bits)
