from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import ModelLoadError, load_model
from engine.tiny import build_tiny


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_a_file_is_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="not a folder"):
        load_model(tmp_path / "model.gguf")


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json is missing"):
        load_model(tmp_path)


def test_not_a_causal_lm(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ModelLoadError, match="not a causal language model"):
        load_model(tmp_path)


def test_untested_architecture_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ModelLoadError, match="not a causal language model"):
        load_model(tmp_path)
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="supports qwen2, llama"):
        load_model(tmp_path)


def test_no_weights(tmp_path: Path) -> None:
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="no weights"):
        load_model(tmp_path)


def test_a_saved_model_folder_loads(tmp_path: Path) -> None:
    loaded = load_model(save_tiny(tmp_path / "tiny"), device="cpu", dtype="float32")
    assert loaded.model_id == "tiny"
    assert loaded.tokenizer.pad_token_id is not None


def save_tiny(folder: Path) -> Path:
    """A tiny model folder that `load_model` accepts, as MODEL_PATH would name it."""
    loaded = build_tiny("qwen2")
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return folder
