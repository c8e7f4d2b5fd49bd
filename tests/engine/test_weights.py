from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from engine import ModelLoadError, weights


def test_reassembly_verifies_the_checksum(tmp_path: Path) -> None:
    parts = []
    for i, chunk in enumerate([b"abc", b"def"]):
        parts.append(tmp_path / f"part{i}")
        parts[-1].write_bytes(chunk)
    target = tmp_path / "model.gguf"
    seen: list[tuple[int, int]] = []
    weights.reassemble(parts, target, hashlib.sha256(b"abcdef").hexdigest(), lambda d, t: seen.append((d, t)))
    assert target.read_bytes() == b"abcdef"
    assert seen[-1] == (6, 6)
    with pytest.raises(ModelLoadError, match="checksum mismatch"):
        weights.reassemble(parts, target, "0" * 64)
    assert not target.exists()


def test_missing_model_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights, "PART_DISTRIBUTIONS", ("deepanalyze-no-such-part",))
    with pytest.raises(ModelLoadError, match=r"not installed.*MODEL_PATH"):
        weights.part_files()


def test_installed_parts_are_found_in_order() -> None:
    files = weights.part_files()
    assert [f.name for f in files] == [f"part0{i}.bin" for i in range(1, 7)]


def test_cache_marker_must_name_the_pinned_checksum(tmp_path: Path) -> None:
    assert not weights.is_prepared(tmp_path)
    (tmp_path / "deepanalyze-source.json").write_text(json.dumps({"gguf_sha256": "other"}))
    assert not weights.is_prepared(tmp_path)
    (tmp_path / "deepanalyze-source.json").write_text(json.dumps({"gguf_sha256": weights.GGUF_SHA256}))
    assert weights.is_prepared(tmp_path)
