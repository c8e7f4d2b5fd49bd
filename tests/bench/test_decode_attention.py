"""The decode-attention benchmark: every build this CPU runs is checked against torch's path and
timed in every round."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench import decode_attention
from engine import kv_native


def test_every_build_this_cpu_runs_is_checked_and_timed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kv_native._compiler() is None:
        pytest.skip("no C compiler: only torch reads here")
    out = tmp_path / "attention.json"
    argv = ["decode_attention", "--seqs", "3", "--history", "40", "--layers", "2", "--steps", "1",
            "--rounds", "2", "--bits", "16,4", "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    decode_attention.main()
    cases = json.loads(out.read_text())["cases"]
    names = {"gathered (torch)", *decode_attention.builds()}
    assert any(name.startswith("in place, this CPU's") for name in names)
    expected = {(d, bits, name) for d in decode_attention.DTYPES for bits in (16, 4) for name in names}
    assert {(c["dtype"], c["bits"], c["reader"]) for c in cases} == expected
    for case in cases:
        assert len(case["s_per_step"]) == 2 and all(t > 0 for t in case["s_per_step"])
        assert case["reader"] != "gathered (torch)" or case["speed_vs_torch"] == [1.0, 1.0]
