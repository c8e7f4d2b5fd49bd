"""The MLP fusion benchmark: both variants timed at every row count, over MLPs that compute the
same thing (so the table compares two ways of one product, not two products)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.engine_variants import SeparateMLP
from bench.mlp_fusion import build_layers, main


def test_the_fused_and_separate_mlps_it_times_agree() -> None:
    mlps = build_layers(32, 96, 2, torch.float32)
    x = torch.randn(1, 5, 32)
    with torch.inference_mode():
        for mlp in mlps:
            expected = SeparateMLP(mlp)(x)
            assert expected.abs().amax() > 0.1
            torch.testing.assert_close(mlp(x), expected)


def test_every_row_count_gets_both_variants_in_every_round(tmp_path: Path) -> None:
    out = tmp_path / "mlp.json"
    args = ["--dtype", "float32", "--hidden", "32", "--intermediate", "96", "--layers", "2"]
    assert main([*args, "--rows", "1,7", "--rounds", "3", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["rows"] for r in results] == [1, 7]
    for r in results:
        assert all(len(r["rounds"][name]) == 3 for name in ("separate", "fused"))
        assert r["fused_over_separate"] == r["ms_per_layer"]["fused"] / r["ms_per_layer"]["separate"]
