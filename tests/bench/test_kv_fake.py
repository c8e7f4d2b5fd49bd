"""The fake quantisation stands for the engine: it gives back what the cold store reads, its bytes
are the store's, and a format that quantises nothing changes nothing."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from bench.kv_fake import (
    Format,
    bytes_ratio,
    clipped_round_trip,
    code_bytes,
    codebook_round_trip,
    counted_ratio,
    fake_quantise,
    logprobs,
    outliers,
    part_bytes,
    rope_turn,
    rotary_angles,
    uniform_round_trip,
)
from bench.kv_formats import CLIPS
from engine.kv_cache import ColdStore, KVShape
from engine.kv_quant import QuantFormat, hadamard
from engine.tiny import build_tiny


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("bits", [8, 6, 4])
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


def test_hot_key_channels_are_the_hot_bits_round_trip_and_the_rest_the_layers_bits() -> None:
    torch.manual_seed(1)
    keys = torch.randn(16, 2, 32) * torch.linspace(0.1, 4.0, 32)
    mask = torch.zeros(2, 32, dtype=torch.bool)
    mask[0, :5], mask[1, -3:] = True, True
    int4, _ = fake_quantise(keys, keys, 4, None, (None, None))
    int8, _ = fake_quantise(keys, keys, 8, None, (None, None))
    mixed, _ = fake_quantise(keys, keys, 4, None, (None, None), hot=(mask, 8))
    torch.testing.assert_close(mixed, torch.where(mask, int8, int4), rtol=0, atol=0)
    assert not torch.equal(int4, int8)
    none_hot, _ = fake_quantise(keys, keys, 4, None, (None, None), hot=(torch.zeros_like(mask), 8))
    torch.testing.assert_close(none_hot, int4, rtol=0, atol=0)


def test_each_hot_key_channel_costs_the_difference_of_its_codes() -> None:
    head_dim, layers = 64, 4
    plain, hot = bytes_ratio(Format(), layers, head_dim), bytes_ratio(Format(hot_keys=16), layers, head_dim)
    # 16 channels of 64 at 8 bits instead of 4: 8 more bytes per token, head and layer, of 256
    assert hot - plain == pytest.approx(8 / 256)
    every = Format(hot_keys=head_dim)  # every key channel hot: int8 keys, int4 values
    assert bytes_ratio(every, layers, head_dim) == pytest.approx(
        bytes_ratio(Format(key_bits=8), layers, head_dim)
    )


def test_a_format_with_every_key_channel_hot_reads_as_int8_keys() -> None:
    model = build_tiny("qwen2").model.eval()
    ids = torch.randint(0, model.config.vocab_size, (70,), generator=torch.Generator().manual_seed(6))
    config = model.config
    dim = config.hidden_size // config.num_attention_heads
    every = {
        layer: torch.ones(config.num_key_value_heads, dim, dtype=torch.bool)
        for layer in range(config.num_hidden_layers)
    }
    base = Format(residual=0, sink_blocks=0)
    hot = logprobs(model, ids, 64, replace(base, hot_keys=dim), hot=every)
    torch.testing.assert_close(hot, logprobs(model, ids, 64, replace(base, key_bits=8)), rtol=0, atol=0)
    assert not torch.equal(hot, logprobs(model, ids, 64, base))


def test_hot_value_channels_are_kept_and_the_rest_quantised_over_their_own_range() -> None:
    torch.manual_seed(2)
    values = torch.randn(16, 2, 32)
    values[..., 3] *= 40  # outlier channels that set every token's range
    values[..., 7] *= -30
    mask = torch.zeros(2, 32, dtype=torch.bool)
    mask[:, [3, 7]] = True
    _, plain = fake_quantise(values, values, None, 4, (None, None))
    _, kept = fake_quantise(values, values, None, 4, (None, None), hot_values=mask)
    torch.testing.assert_close(kept[..., [3, 7]], values[..., [3, 7]], rtol=0, atol=0)
    rest = ~mask[0]
    _, alone = fake_quantise(values[..., rest], values[..., rest], None, 4, (None, None))
    torch.testing.assert_close(kept[..., rest], alone, rtol=0, atol=0)  # the outlier no longer in the range
    assert (kept - values).square().sum() < (plain - values).square().sum() / 10


def test_each_hot_value_channel_costs_full_precision_instead_of_its_code() -> None:
    plain, hot = bytes_ratio(Format(), 4, 64), bytes_ratio(Format(hot_values=2), 4, 64)
    assert hot - plain == pytest.approx(2 * (2 - 0.5) / 256)  # bf16 (2 bytes) instead of 4 bits


@pytest.mark.parametrize("per_channel", [True, False])
def test_outliers_are_the_extremes_that_set_their_groups_ranges_and_keeping_them_pays(
    per_channel: bool,
) -> None:
    """Planted extremes are found, `count` a KV head; the kept elements come back exact and the rest
    err less than min-max over the whole group; no group is left with fewer than two elements."""
    torch.manual_seed(2)
    x = torch.randn(16, 2, 64)  # (block, KV heads, channels)
    planted = [(3, 0, 7), (9, 0, 40), (5, 1, 2), (12, 1, 63)]
    for token, head, channel in planted:
        x[token, head, channel] = 30.0 if channel % 2 else -30.0
    kept = outliers(x, 0 if per_channel else -1, 2)
    assert kept.shape == x.shape and kept.sum(dim=(0, 2)).tolist() == [2, 2]
    assert all(bool(kept[p]) for p in planted)
    bits = (4, None) if per_channel else (None, 4)
    plain = fake_quantise(x, x, *bits, (None, None))[0 if per_channel else 1]
    sparse = fake_quantise(x, x, *bits, (None, None), sparse=(2, 0) if per_channel else (0, 2))
    sparse_part = sparse[0 if per_channel else 1]
    torch.testing.assert_close(sparse_part[kept], x[kept], rtol=0, atol=0)
    assert float((sparse_part - x).square().sum()) < 0.5 * float((plain - x).square().sum())
    few = outliers(torch.randn(2, 1, 3), 0, 5)  # groups of two elements: nothing can be taken
    assert not bool(few.any())


def test_kept_outliers_are_counted_as_a_value_and_a_position_each() -> None:
    plain, sparse = bytes_ratio(Format(), 24, 64), bytes_ratio(Format(sparse_keys=8, sparse_values=4), 24, 64)
    # per block of 16 tokens and KV head: 12 elements x (2 bytes + a 2-byte position), over 256 bytes a token
    assert sparse - plain == pytest.approx(12 * 4 / 16 / 256)


def test_per_head_bits_quantise_that_head_alone_and_all_heads_at_their_layer_s_bits_are_its_format() -> None:
    model = build_tiny("qwen2").model.eval()
    ids = torch.randint(3, model.config.vocab_size, (96,), generator=torch.Generator().manual_seed(4))
    reference = logprobs(model, ids, 64, Format(quantise=False))
    layer_wide = logprobs(model, ids, 64, Format(residual=0, layer_bits={0: (8, 4)}))
    heads = {(0, head): (8, 4) for head in range(model.config.num_key_value_heads)}
    torch.testing.assert_close(logprobs(model, ids, 64, Format(residual=0, head_bits=heads)), layer_wide)
    one_head = Format(key_bits=None, value_bits=None, residual=0, head_bits={(0, 1): (4, None)})
    moved = logprobs(model, ids, 64, one_head)
    other = logprobs(model, ids, 64, replace(one_head, head_bits={(0, 0): (4, None)}))
    assert not torch.equal(moved, reference) and not torch.equal(moved, other)  # that head's keys alone
    with pytest.raises(ValueError, match="plain quantiser"):
        logprobs(model, ids, 64, replace(one_head, hot_keys=4))


def test_a_head_at_8_bits_costs_half_of_its_layer_at_8_bits() -> None:
    plain = bytes_ratio(Format(), 24, 64, kv_heads=2)
    layer = bytes_ratio(Format(layer_bits={3: (8, 8)}), 24, 64, kv_heads=2)
    head = bytes_ratio(Format(head_bits={(3, 1): (8, 8)}), 24, 64, kv_heads=2)
    assert head - plain == pytest.approx((layer - plain) / 2)
    assert plain == pytest.approx(bytes_ratio(Format(), 24, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 6, 4])
def test_the_searchs_own_widths_round_as_the_engines_quantiser_at_its_widths(
    bits: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(1)
    keys = (torch.randn(16, 2, 32) * torch.linspace(0.1, 4.0, 32)).to(dtype)
    values = torch.randn(16, 2, 32).to(dtype)
    engine_keys, engine_values = fake_quantise(keys, values, bits, bits, (None, None))
    assert torch.equal(uniform_round_trip(keys, bits, -3), engine_keys)
    assert torch.equal(uniform_round_trip(values, bits, -1), engine_values)


def test_each_bit_about_quarters_the_squared_error_and_widths_past_2_to_8_are_refused() -> None:
    x = torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(2))
    errors = [float((uniform_round_trip(x, bits, -3) - x).pow(2).mean()) for bits in range(2, 9)]
    assert all(0.15 < finer / coarser < 0.4 for coarser, finer in itertools.pairwise(errors))
    for bits in (1, 9):
        with pytest.raises(ValueError, match="2 to 8 bits"):
            uniform_round_trip(x, bits, -1)


def test_a_parts_bytes_are_its_codes_packed_tight_and_its_scales() -> None:
    assert code_bytes(6, 64) == 48 and code_bytes(3, 64) == 24 and code_bytes(4, 64) == 32
    assert part_bytes(6, 64, keys=True) == 48 + 16  # a scale and an offset per channel over 16 tokens
    assert part_bytes(6, 64, keys=False) == 48 + 4  # a scale and an offset per token
    assert part_bytes(None, 64, keys=True) == 128
    uniform = Format(key_bits=6, value_bits=6)
    assert bytes_ratio(uniform, 24, 64) == pytest.approx((64 + 52) / 256)


@pytest.mark.parametrize("bits", [8, 6, 5, 4])
@pytest.mark.parametrize("rotate", [False, True])
def test_keys_per_token_are_quantised_as_values_are_and_per_channel_keys_are_not(
    bits: int, rotate: bool
) -> None:
    torch.manual_seed(3)
    x = torch.randn(16, 2, 64) * torch.linspace(0.1, 4.0, 64)  # channels of unequal range
    h = hadamard(64) if rotate else None
    per_token, values = fake_quantise(x, x, bits, bits, (h, h), keys_per_token=True)
    assert torch.equal(per_token, values)
    per_channel, _ = fake_quantise(x, x, bits, bits, (h, h))
    assert not torch.equal(per_channel, per_token)


@pytest.mark.parametrize("bits", [5, 3])
def test_a_rotated_width_the_engine_does_not_store_rounds_the_rotated_tensor_and_turns_it_back(
    bits: int,
) -> None:
    x = torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(4))
    h = hadamard(64)
    _, rotated = fake_quantise(x, x, None, bits, (None, h))
    torch.testing.assert_close(rotated, uniform_round_trip(x @ h, bits, -1) @ h)


def test_keys_per_token_cost_a_scale_and_an_offset_per_token_not_per_channel_and_block() -> None:
    assert bytes_ratio(Format(keys_per_token=True), 24, 64) == pytest.approx((32 + 4 + 32 + 4) / 256)
    assert bytes_ratio(Format(key_bits=6, value_bits=5, keys_per_token=True), 24, 64) == pytest.approx(
        (48 + 4 + 40 + 4) / 256
    )
    assert bytes_ratio(Format(), 24, 64) == pytest.approx((32 + 16 + 32 + 4) / 256)


@pytest.mark.parametrize(
    "settings",
    [{"hot_keys": 8}, {"sparse_keys": 4}, {"codebook": True}, {"pre_rope_keys": True}, {"key_blocks": 2}],
)
def test_keys_per_token_refuse_the_per_channel_quantisers(settings: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="keys_per_token"):
        Format(keys_per_token=True, **settings)  # type: ignore[arg-type]


def test_a_layer_whose_keys_stay_per_channel_costs_per_channel_scales_there_only() -> None:
    fmt = Format(keys_per_token=True, channel_key_layers=(0,))
    assert fmt.keys_per_token_in(1) and not fmt.keys_per_token_in(0)
    per_token, per_channel = 32 + 4 + 32 + 4, 32 + 16 + 32 + 4
    assert bytes_ratio(fmt, 24, 64) == pytest.approx((23 * per_token + per_channel) / 24 / 256)
