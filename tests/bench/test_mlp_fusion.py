"""The MLP fusion benchmark: what it times computes what transformers' MLP computes (so the table
compares two ways of one product, not two products), each row independently of the others, and
both variants are timed at every row count in every round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.mlp_fusion import FusedMLP, SeparateMLP, main
from engine.linear import PackedLinear, can_pack
from engine.tiny import build_tiny

CPU = torch.device("cpu")
BF16 = pytest.mark.skipif(not can_pack(CPU, torch.bfloat16), reason="no native bf16 here: nothing packed")


def _linears(dtype: torch.dtype) -> tuple[torch.nn.Linear, torch.nn.Linear, torch.nn.Linear]:
    """A gate, an up and a down projection (64 -> 160 -> 64), weights large enough that SiLU's
    curve is exercised, not only its linear middle."""
    torch.manual_seed(0)
    parts = (torch.nn.Linear(64, 160, bias=False), torch.nn.Linear(64, 160, bias=False),
             torch.nn.Linear(160, 64, bias=False))  # fmt: skip
    for part in parts:
        torch.nn.init.normal_(part.weight, std=0.2)
    gate, up, down = (part.to(dtype) for part in parts)
    return gate, up, down


def _fused(dtype: torch.dtype) -> FusedMLP:
    return FusedMLP(*(PackedLinear(part) for part in _linears(dtype)))


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_the_fused_mlp_gives_the_plain_mlps_outputs_in_fp32(rows: int) -> None:
    """Against transformers' own MLP (a tiny Qwen2's, given the same weights)."""
    plain = build_tiny("qwen2", dtype=torch.float32).model.model.layers[0].mlp
    plain.gate_proj, plain.up_proj, plain.down_proj = _linears(torch.float32)
    fused = _fused(torch.float32)
    x = torch.randn(1, rows, 64)
    with torch.inference_mode():
        expected = plain(x)
        assert expected.abs().amax() > 1
        torch.testing.assert_close(fused(x), expected)
        torch.testing.assert_close(SeparateMLP(fused.gate_proj, fused.up_proj, fused.down_proj)(x), expected)


@BF16
def test_the_fused_mlp_in_bf16_is_no_further_from_fp32_than_the_separate_one() -> None:
    """In bf16 the separate MLP rounds its intermediates twice more than the fused one."""
    fused = _fused(torch.bfloat16)
    separate = SeparateMLP(fused.gate_proj, fused.up_proj, fused.down_proj)
    gate, up, down = (part.float() for part in _linears(torch.bfloat16))
    x = torch.randn(1, 300, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        truth = down(torch.nn.functional.silu(gate(x.float())) * up(x.float()))
        fused_error = (fused(x).float() - truth).abs().mean()
        assert fused_error <= (separate(x).float() - truth).abs().mean()
        assert fused_error < 0.01 * truth.abs().mean()


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=BF16)])
def test_a_fused_rows_output_does_not_depend_on_the_other_rows(dtype: torch.dtype) -> None:
    """What the engine's exactness through batching would need from it: bit for bit."""
    fused = _fused(dtype)
    x = torch.randn(64, 64, dtype=dtype)
    with torch.inference_mode():
        together = fused(x)
        for row in (0, 5, 63):
            assert torch.equal(fused(x[row : row + 1]), together[row : row + 1])


def test_every_row_count_gets_both_variants_in_every_round(tmp_path: Path) -> None:
    out = tmp_path / "mlp.json"
    args = ["--dtype", "float32", "--hidden", "32", "--intermediate", "96", "--layers", "2"]
    assert main([*args, "--rows", "1,7", "--rounds", "3", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["rows"] for r in results] == [1, 7]
    for r in results:
        assert all(len(r["rounds"][name]) == 3 for name in ("separate", "fused"))
        assert r["fused_over_separate"] == r["ms_per_layer"]["fused"] / r["ms_per_layer"]["separate"]
