"""The KV read benchmark times every reader this CPU runs on the same rows, after checking that
each one reads what torch reads, and records each case for both dtypes and both bit widths."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench import kv_read
from engine import kv_native


def test_every_reader_this_cpu_runs_is_checked_and_timed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kv_native._compiler() is None:
        pytest.skip("no C compiler: only torch reads here")
    out = tmp_path / "read.json"
    argv = ["kv_read", "--seqs", "2", "--history", "64", "--reads", "1", "--rounds", "2", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    kv_read.main()
    cases = json.loads(out.read_text())["cases"]
    readers = set(kv_read.readers())
    assert "torch" in readers and any(name.endswith("(this CPU's)") for name in readers)
    assert {(c["dtype"], c["bits"], c["reader"]) for c in cases} == {
        (dtype, bits, reader) for dtype in kv_read.DTYPES for bits in (8, 4) for reader in readers
    }
    for case in cases:
        assert len(case["s_per_read"]) == 2 and all(t > 0 for t in case["s_per_read"])
        assert case["reader"] != "torch" or case["speed_vs_torch"] == [1.0, 1.0]
