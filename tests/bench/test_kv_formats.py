"""The format search stands for the engine: its fake quantisation is what the cold store gives back,
its bytes are the store's, and a format that quantises nothing changes nothing."""

from __future__ import annotations

import pytest
import torch

from bench.kv_formats import Format, bytes_ratio, fake_quantise, logprobs
from engine.kv_cache import ColdStore, KVShape
from engine.kv_quant import QuantFormat, hadamard
from engine.tiny import build_tiny


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
def test_fake_quantisation_gives_back_what_the_cold_store_reads(bits: int, rotate: bool) -> None:
    torch.manual_seed(0)
    size, heads, dim = 16, 2, 32
    keys = torch.randn(size, heads, dim) * torch.linspace(0.1, 4.0, dim)  # channels of unequal range
    values = torch.randn(size, heads, dim)
    store = ColdStore(KVShape(1, heads, dim, torch.float32), QuantFormat(bits), 1, size, torch.device("cpu"),
                      rotate=rotate)  # fmt: skip
    store.store(keys[None, None], values[None, None], torch.tensor([0]))
    read = store.gathered(0, torch.arange(heads), pairs=heads)  # (KVH, bs, D)
    h = hadamard(dim) if rotate else None
    fake_keys, fake_values = fake_quantise(keys, values, bits, bits, (h, h))
    torch.testing.assert_close(fake_keys.transpose(0, 1), read.keys, rtol=0, atol=1e-4)
    torch.testing.assert_close(fake_values.transpose(0, 1), read.values, rtol=0, atol=1e-4)
    assert not torch.equal(fake_keys, keys)  # something was quantised


def test_bytes_per_token_are_the_cold_stores_for_uniform_formats() -> None:
    shape = KVShape(num_layers=24, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    for bits in (8, 4):
        store_ratio = ColdStore.bytes_per_block(shape, QuantFormat(bits), 16) / 16 / shape.bytes_per_token
        assert bytes_ratio(Format(key_bits=bits, value_bits=bits), 24, 64) == pytest.approx(store_ratio)
    mixed = Format(layer_bits={0: (8, 8)})  # one layer of 24 at int8, the rest int4
    assert bytes_ratio(mixed, 24, 64) == pytest.approx((23 * 84 + 148) / 24 / 256)
    assert bytes_ratio(Format(quantise=False), 24, 64) == 1.0


def test_a_format_that_quantises_nothing_leaves_the_distributions_alone_and_int4_does_not() -> None:
    model = build_tiny().model.eval()
    ids = torch.randint(3, model.config.vocab_size, (120,))
    reference = logprobs(model, ids, 80, Format(quantise=False, prompt_chunk=48))
    nothing = Format(key_bits=None, value_bits=None, residual=0, prompt_chunk=48)
    torch.testing.assert_close(logprobs(model, ids, 80, nothing), reference)
    int4 = logprobs(model, ids, 80, Format(residual=0, prompt_chunk=48))
    assert int4.shape == reference.shape == (40, model.config.vocab_size)
    assert (reference.exp() * (reference - int4)).sum(-1).mean() > 1e-6


def test_key_scales_shared_by_two_blocks_halve_the_keys_scale_bytes() -> None:
    head_dim, layers = 64, 4
    one, two = bytes_ratio(Format(), layers, head_dim), bytes_ratio(Format(key_blocks=2), layers, head_dim)
    # a scale and an offset (bf16) per channel: 4 * head_dim bytes per 16 tokens, now per 32
    assert one - two == pytest.approx((4 * head_dim / 32) / (4 * head_dim))
