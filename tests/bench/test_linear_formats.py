"""The linear-format benchmark converts what the engine packs (every decoder linear and the head),
leaves the reference model alone, times the model's own shapes, and states each int8 format's
batch dependence truthfully; the int8 formats' quality is read from the products their integer
kernels compute."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bench.linear_formats import CONVERT, QUALITY, DequantisedInt8Linear, RowInt8Linear, convert, layer_shapes
from engine.linear import PackedLinear, can_pack
from engine.tiny import build_tiny


def test_the_shapes_timed_are_the_models_own() -> None:
    model = build_tiny("qwen2").model
    layer = model.model.layers[0]
    own = sorted((m.in_features, m.out_features) for m in layer.modules() if isinstance(m, nn.Linear))
    assert sorted(layer_shapes(model.config)) == own


def test_each_format_converts_every_decoder_linear_and_the_head_of_a_copy() -> None:
    model = build_tiny("qwen2").model.eval()
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8]])
    with torch.inference_mode():
        reference = model(ids).logits
        packed, int8, rows = convert(model, "packed"), convert(model, "int8"), convert(model, "int8-row")
        assert isinstance(packed.lm_head, PackedLinear) and isinstance(rows.lm_head, RowInt8Linear)
        assert not any(type(m) is nn.Linear for c in (packed, int8, rows) for m in c.modules())
        assert sum(type(m) is nn.Linear for m in model.modules()) > 0  # the reference is untouched
        torch.testing.assert_close(packed(ids).logits, reference)
        quantised = [int8(ids).logits, rows(ids).logits]
    for logits in quantised:
        assert not torch.equal(logits, reference)  # something was quantised ...
        assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.75  # ... and little


@pytest.mark.parametrize(("fmt", "independent"), [("int8", False), ("int8-row", True)])
def test_which_int8_format_keeps_a_rows_product_independent_of_its_batch(fmt: str, independent: bool) -> None:
    """Dynamic int8 has one activation scale per call, so a row multiplied beside a row of larger
    range comes out different (the engine would lose its batch independence); a scale per row
    keeps it, and computes the product of the rounded weights."""
    torch.manual_seed(0)
    module = CONVERT[fmt](nn.Linear(64, 32))
    row = torch.randn(1, 64)
    with torch.inference_mode():
        alone = module(row)
        beside = module(torch.cat([row, 50 * torch.randn(40, 64)]))[:1]
    assert torch.equal(alone, beside) is independent
    if isinstance(module, RowInt8Linear):
        exact = nn.functional.linear(row, module.codes_t.t().float() * module.scales[:, None], module.bias)
        torch.testing.assert_close(alone, exact, rtol=0.02, atol=0.02)  # the weights' own rounding aside


def test_the_dequantised_per_row_product_is_the_integer_kernels_product() -> None:
    """Quality is measured without the slow integer product; that must not change the numbers."""
    torch.manual_seed(0)
    linear = nn.Linear(128, 48)
    x = torch.randn(20, 128) * torch.linspace(0.1, 8, 128)
    with torch.inference_mode():
        integer, dequantised = RowInt8Linear(linear)(x), QUALITY["int8-row"](linear)(x)
    torch.testing.assert_close(dequantised, integer, rtol=1e-5, atol=1e-4)


def test_a_group_scale_keeps_an_outlier_channels_error_inside_its_group() -> None:
    """With one scale per row, an outlier channel coarsens every channel's codes; with a scale per
    group of 32 only the outlier's group is coarser, so the product errs less."""
    torch.manual_seed(0)
    linear = nn.Linear(128, 64, bias=False)
    x = torch.randn(16, 128)
    x[:, 5] = 300.0  # one massive activation channel, as the model's residual stream has
    exact = linear(x).detach()
    with torch.inference_mode():
        errors = {g: (DequantisedInt8Linear(linear, g)(x) - exact).abs().mean().item() for g in (None, 32)}
    assert errors[32] < errors[None] / 2
    with pytest.raises(ValueError, match="groups of 32"):
        DequantisedInt8Linear(nn.Linear(40, 8), 32)


def test_the_bf16_formats_multiply_in_bf16_from_a_copy_and_agree_with_each_other() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.inference_mode():
        plain = CONVERT["plain-bf16"](linear)(x)
        assert plain.dtype == torch.bfloat16 and linear.weight.dtype == torch.float32  # a copy converted
        torch.testing.assert_close(plain.float(), linear(x.float()), rtol=0.05, atol=0.05)
        if can_pack(torch.device("cpu"), torch.bfloat16):
            torch.testing.assert_close(CONVERT["packed-bf16"](linear)(x), plain)
