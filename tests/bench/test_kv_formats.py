"""The format search stands for the engine: its fake quantisation is what the cold store gives back,
its bytes are the store's, and a format that quantises nothing changes nothing."""

from __future__ import annotations

import pytest
import torch

from bench.kv_formats import (
    CLIPS,
    Format,
    bytes_ratio,
    calibrate,
    clipped_round_trip,
    codebook_round_trip,
    counted_ratio,
    fake_quantise,
    lloyd_levels,
    logprobs,
    nearest_level,
    rope_turn,
    rotary_angles,
    round_trip_errors,
)
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


def test_counted_bytes_hold_the_sink_the_window_and_the_block_being_written_at_full_precision() -> None:
    """100 tokens in 16-token blocks: 7 blocks, the last one partial."""
    cold = bytes_ratio(Format(), 24, 64)
    # window 32: blocks 4.. hold tokens 68 onwards or are being written; block 0 is the sink
    assert counted_ratio(Format(), 24, 64, 100) == pytest.approx((3 * cold + 4) * 16 / 100)
    # no window, no sink: only the partial block stays full precision
    assert counted_ratio(Format(residual=0, sink_blocks=0), 24, 64, 100) == pytest.approx(
        (6 * cold + 1) * 16 / 100
    )
    assert counted_ratio(Format(residual=0, sink_blocks=0), 24, 64, 96) == pytest.approx(cold)
    assert counted_ratio(Format(residual=64), 24, 64, 40) == pytest.approx(48 / 40)  # all hot, whole blocks
    assert counted_ratio(Format(quantise=False), 24, 64, 100) == pytest.approx(112 / 100)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_clipped_value_range_is_min_max_at_ratio_one_and_never_worse_with_more_ratios(bits: int) -> None:
    torch.manual_seed(0)
    values = torch.randn(16, 2, 64) * torch.rand(16, 2, 1) * 3  # (tokens, KV heads, channels)
    values[3, 1, 7] = 25.0  # one token's outlier channel
    _, engine = fake_quantise(values, values, None, bits, (None, None))
    torch.testing.assert_close(clipped_round_trip(values, bits, (1.0,)), engine, rtol=0, atol=1e-5)
    searched = clipped_round_trip(values, bits, CLIPS)
    plain_error = (engine - values).square().sum(-1)
    searched_error = (searched - values).square().sum(-1)
    assert bool((searched_error <= plain_error * (1 + 1e-4) + 1e-6).all())  # 1.0 is among the ratios
    if bits == 4:  # 15 levels for a row with an outlier: a narrower range pays
        assert float(searched_error.sum()) < 0.95 * float(plain_error.sum())


def test_keys_turned_back_by_the_rotary_angles_are_the_projections_before_rotary_embedding() -> None:
    """The cache holds keys after rotary embedding; `rope_turn` with the model's own angles gives
    back layer 0's key projection of the same tokens (what pre-RoPE quantisation quantises), and
    turning them forward again gives the cached keys."""
    from transformers import DynamicCache

    model = build_tiny("qwen2").model.eval()
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8, 11, 12]])
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True)
        attention = model.model.layers[0].self_attn
        hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        projected = attention.k_proj(hidden)[0].view(ids.shape[1], -1, attention.head_dim)  # (T, KVH, D)
    cached = cache.layers[0].keys[0].transpose(0, 1)  # (T, KVH, D), after rotary embedding
    cos, sin = rotary_angles(model, ids.shape[1])
    plain = rope_turn(cached, cos, sin, -1.0)
    torch.testing.assert_close(plain, projected.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(rope_turn(plain, cos, sin, 1.0), cached.float(), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(cached.float(), projected.float(), atol=1e-3)  # the embedding turned them


def test_pre_rope_int4_keys_disturb_the_distributions_and_leave_a_no_quantisation_run_alone() -> None:
    model = build_tiny("qwen2").model.eval()
    ids = torch.randint(0, model.config.vocab_size, (96,), generator=torch.Generator().manual_seed(3))
    reference = logprobs(model, ids, 64, Format(quantise=False))
    unquantised = logprobs(model, ids, 64, Format(quantise=False, pre_rope_keys=True))
    torch.testing.assert_close(unquantised, reference)
    pre_rope = logprobs(
        model, ids, 64, Format(value_bits=None, pre_rope_keys=True, residual=0, sink_blocks=0)
    )
    assert not torch.allclose(pre_rope, reference)


def test_a_codebook_of_even_levels_is_the_engines_min_max_quantiser() -> None:
    torch.manual_seed(1)
    keys = torch.randn(16, 2, 64) * torch.linspace(0.1, 4.0, 64)
    values = torch.randn(16, 2, 64)
    even = torch.linspace(0, 1, 16)
    engine_keys, engine_values = fake_quantise(keys, values, 4, 4, (None, None))
    torch.testing.assert_close(codebook_round_trip(keys, even, -3), engine_keys, rtol=0, atol=1e-5)
    torch.testing.assert_close(codebook_round_trip(values, even, -1), engine_values, rtol=0, atol=1e-5)
    coded_keys, coded_values = fake_quantise(keys, values, 4, 4, (None, None), levels=(even, even))
    torch.testing.assert_close(coded_keys, engine_keys, rtol=0, atol=1e-5)
    torch.testing.assert_close(coded_values, engine_values, rtol=0, atol=1e-5)


def test_fitted_levels_keep_the_ends_and_cut_the_error_of_bell_shaped_samples() -> None:
    samples = (torch.randn(20_000, generator=torch.Generator().manual_seed(2)) * 0.12 + 0.5).clamp(
        0.001, 0.999
    )
    levels = lloyd_levels(samples)
    assert levels[0] == 0 and levels[-1] == 1 and bool((levels.diff() > 0).all())

    def error(grid: torch.Tensor) -> float:
        nearest = grid[nearest_level(samples, grid)]
        return float((nearest - samples).square().mean())

    assert error(levels) < 0.8 * error(torch.linspace(0, 1, 16))  # denser where the samples are
    rows = samples[:6400].view(100, 64)  # each row's min and max are read back exactly
    back = codebook_round_trip(rows, levels, -1)
    torch.testing.assert_close(back.amin(-1), rows.amin(-1))
    torch.testing.assert_close(back.amax(-1), rows.amax(-1))


def test_calibration_fits_levels_for_every_layer_s_keys_and_values() -> None:
    model = build_tiny("qwen2").model.eval()
    ids = torch.randint(0, model.config.vocab_size, (70,), generator=torch.Generator().manual_seed(4))
    books = calibrate(model, [(ids, 64)])
    assert sorted(books) == list(range(model.config.num_hidden_layers))
    for key_levels, value_levels in books.values():
        for levels in (key_levels, value_levels):
            assert levels.shape == (16,) and levels[0] == 0 and levels[-1] == 1
    reference = logprobs(model, ids, 64, Format(quantise=False))
    coded = logprobs(model, ids, 64, Format(codebook=True, residual=0, sink_blocks=0), books)
    assert coded.shape == reference.shape and not torch.allclose(coded, reference)


def test_round_trip_errors_equal_for_even_levels_and_lower_for_levels_fitted_to_the_same_prompts() -> None:
    model = build_tiny("qwen2").model.eval()
    ids = torch.randint(0, model.config.vocab_size, (70,), generator=torch.Generator().manual_seed(5))
    layers = range(model.config.num_hidden_layers)
    even = torch.linspace(0, 1, 16)
    errors = round_trip_errors(model, [(ids, 64)], dict.fromkeys(layers, (even, even)))
    assert set(errors) == {"keys uniform", "keys codebook", "values uniform", "values codebook"}
    for part in ("keys", "values"):
        assert errors[f"{part} uniform"] > 0
        assert errors[f"{part} codebook"] == pytest.approx(errors[f"{part} uniform"], rel=1e-4)
    fitted = round_trip_errors(model, [(ids, 64)], calibrate(model, [(ids, 64)]))
    for part in ("keys", "values"):  # Lloyd-Max on these very groups: never worse than even levels
        assert fitted[f"{part} codebook"] <= fitted[f"{part} uniform"] * 1.001
