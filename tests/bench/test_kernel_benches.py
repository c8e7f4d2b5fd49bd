"""The benchmarks of the native prompt attention and element-wise kernels: every case checked
against torch and timed in every round, on every build this CPU runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from bench import common, fused_layers, prompt_attention
from engine import kv_native


def run(
    module: ModuleType, argv: list[str], out: Path, monkeypatch: pytest.MonkeyPatch
) -> list[dict[str, Any]]:
    if kv_native._compiler() is None:
        pytest.skip("no C compiler: the native kernels are not built here")
    monkeypatch.setattr(sys, "argv", [module.__name__, *argv, "--rounds", "2", "--out", str(out)])
    module.main()
    cases: list[dict[str, Any]] = json.loads(out.read_text())["cases"]
    return cases


def test_prompt_attention_times_every_chunk_shape_both_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each chunk shape timed by torch and by every in-place path (vectors; tiles on AMX) in both rounds."""
    kernel = kv_native.load()
    if kernel is None or kernel.prompt_isa(torch.bfloat16, prompt_attention.HEAD_DIM) is None:
        pytest.skip("prompt chunks are attended in place only by the AVX-512 BF16 and AMX builds")
    cases = run(prompt_attention, ["--layers", "1", "--repeats", "1"], tmp_path / "p.json", monkeypatch)
    assert [(c["history"], c["chunk"]) for c in cases] == list(prompt_attention.CASES)
    paths = ["vectors", "tiles"] if kernel.tiles else ["vectors"]
    for case in cases:
        assert len(case["torch_s"]) == 2 and [p for p in paths if p in case] == paths
        assert all(len(case[p]["s"]) == 2 and min(case[p]["s"]) > 0 for p in paths)
        assert all(len(case[p]["speed_vs_baseline"]) == 2 for p in paths)


def test_fused_layers_times_every_kind_of_work_on_every_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cases = run(fused_layers, ["--rows", "1,3", "--layers", "1"], tmp_path / "f.json", monkeypatch)
    builds = set(common.kernel_builds())
    works = ("rmsnorm", "silu * up", "rope")
    expected = {(d, rows, work) for d in fused_layers.DTYPES for rows in (1, 3) for work in works}
    assert {(c["dtype"], c["rows"], c["work"]) for c in cases} == expected
    for case in cases:
        assert set(case["builds"]) == builds and len(case["torch_s"]) == 2
        assert all(len(b["speed_vs_baseline"]) == 2 for b in case["builds"].values())
