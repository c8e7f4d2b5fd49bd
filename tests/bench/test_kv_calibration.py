"""What the fitted formats are fitted on: levels that keep a group's ends and cut its error, and
channel weights that follow the queries and the output projection that read the cache."""

from __future__ import annotations

import pytest
import torch

from bench.kv_calibration import (
    calibrate,
    calibration_documents,
    channel_weights,
    choose_channels,
    hot_channels,
    lloyd_levels,
    round_trip_errors,
)
from bench.kv_fake import Format, codebook_round_trip, logprobs, nearest_level
from bench.kv_quality import load_corpus
from engine.tiny import build_tiny


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


def test_a_key_channel_no_query_reads_weighs_nothing_and_is_never_hot() -> None:
    """Queries zeroed in channel pair (2, 2 + D/2) of the heads reading KV head 0, before rotary
    embedding: after it both channels are zero there, so their weight is zero for KV head 0 and
    not for KV head 1."""
    model = build_tiny("qwen2").model.eval()
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    rows = [h * dim + c for h in range(heads // kv_heads) for c in (2, 2 + dim // 2)]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight[rows] = 0
            layer.self_attn.q_proj.bias[rows] = 0
    ids = torch.randint(0, config.vocab_size, (70,), generator=torch.Generator().manual_seed(7))
    weights, _ = channel_weights(model, [(ids, 64)])
    assert sorted(weights) == list(range(config.num_hidden_layers))
    for w in weights.values():
        assert w.shape == (kv_heads, dim) and bool((w >= 0).all())
        assert float(w[0, 2]) == float(w[0, 2 + dim // 2]) == 0.0
        assert float(w[1, 2]) > 0 and float(w[1, 2 + dim // 2]) > 0
    for mask in hot_channels(weights, dim - 2).values():
        assert mask.sum(-1).tolist() == [dim - 2] * kv_heads
        assert not mask[0, 2] and not mask[0, 2 + dim // 2]


def test_a_value_channel_no_output_reads_weighs_nothing() -> None:
    """The output projection's columns for channel 5 of the heads reading KV head 1 zeroed: that
    value channel weighs nothing there, and something for KV head 0."""
    model = build_tiny("qwen2").model.eval()
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    columns = [h * dim + 5 for h in range(heads // kv_heads, heads)]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[:, columns] = 0
    ids = torch.randint(0, config.vocab_size, (70,), generator=torch.Generator().manual_seed(8))
    _, weights = channel_weights(model, [(ids, 64)])
    assert sorted(weights) == list(range(config.num_hidden_layers))
    for w in weights.values():
        assert w.shape == (kv_heads, dim) and float(w[1, 5]) == 0.0 and float(w[0, 5]) > 0


def test_pooled_hot_channels_are_as_many_as_per_head_ones_and_go_where_the_weight_is() -> None:
    weights = {0: torch.rand(2, 8) + 10, 1: torch.rand(2, 8)}  # layer 0 weighs far more
    each = hot_channels(weights, 2)
    pooled = hot_channels(weights, 2, pooled=True)
    assert sum(int(m.sum()) for m in each.values()) == sum(int(m.sum()) for m in pooled.values()) == 8
    assert int(pooled[0].sum()) == 8 and int(pooled[1].sum()) == 0
    for layer, mask in each.items():  # per head: the two largest of each row
        assert torch.equal(mask, weights[layer] >= weights[layer].topk(2).values[:, -1:])


def test_channels_are_chosen_once_per_choice_that_the_formats_read() -> None:
    model = build_tiny("qwen2").model.eval()
    ids = torch.randint(0, model.config.vocab_size, (70,), generator=torch.Generator().manual_seed(9))
    formats = [Format(hot_keys=2), Format(hot_keys=2, hot_values=2), Format(hot_keys=2, hot_keys_pooled=True)]
    channels = choose_channels(model, [(ids, 64)], formats)
    assert sorted(channels.keys) == ["2", "2 pooled"] and sorted(channels.values) == [2]
    assert all(f.hot_key_choice() in channels.keys for f in formats)
    for shares in channels.key_shares["2"].values():  # 2 channels' share of a head's weight
        assert all(0 < share < 1 for share in shares)
    assert choose_channels(model, [(ids, 64)], [Format()]) == type(channels)({}, {}, {})


def test_calibration_documents_are_spread_over_the_corpus_and_never_evaluated() -> None:
    evaluated = load_corpus(24)
    chosen = calibration_documents(evaluated, 6)
    ids = [d["document_id"] for d in chosen]
    assert len(set(ids)) == 6
    assert not set(ids) & {d["document_id"] for d in evaluated}
    assert len({d["kind"] for d in chosen}) > 1  # evenly spaced over a corpus ordered by kind
