"""The KV quality benchmark's profiles are engine settings the engine knows (a misspelt key would
be ignored by the configuration, and the profile would silently run uncompressed)."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.kv_quality import (
    PROFILES,
    DocResult,
    Reference,
    load_reference,
    real_documents,
    save_reference,
)
from bench.real_data import Labelled
from engine import EngineConfig


def test_every_profile_names_only_engine_settings_and_builds_a_configuration() -> None:
    for name, settings in PROFILES.items():
        assert set(settings) <= set(EngineConfig.model_fields), name
        config = EngineConfig(model_path=Path("unused"), **settings)
        assert config.quantising or config.pruning or not settings.get("kv_compression"), name


def test_real_documents_take_an_equal_evenly_spaced_share_of_each_language_and_label() -> None:
    sample = [
        Labelled(f"src-{lang}", lang, f"{lang}-{pol}-{i}", pol)
        for lang in ("en", "zh") for pol in ("positive", "negative") for i in range(10)
    ]  # fmt: skip
    docs = real_documents(sample, 8)
    assert len(docs) == 8 and len({d["document_id"] for d in docs}) == 8
    for lang, kind in (("en", "complaint"), ("zh", "filing")):
        for pol in ("positive", "negative"):
            mine = [d for d in docs if d["language"] == lang and d["label_polarity"] == pol]
            assert [d["text"] for d in mine] == [f"{lang}-{pol}-0", f"{lang}-{pol}-5"]
            assert {d["kind"] for d in mine} == {kind}


def test_a_saved_reference_comes_back_whole_only_under_the_key_it_was_made_with(tmp_path: Path) -> None:
    result = DocResult("d", "complaint", "zh", 3, "negative", 10, [1, 2, 3], 1.0, 0.5, True,
                       {"sentiment": {"polarity": "negative"}}, 100, 10, kl=[0.1], top1=[True])  # fmt: skip
    ids, logp = torch.arange(12, dtype=torch.int32).view(3, 4), torch.randn(3, 4)
    key = {"model": "m", "dtype": "torch.bfloat16", "documents": ["d"], "tf_tokens": 2}
    path = tmp_path / "ref.pt"
    save_reference(path, key, ([result], Reference([ids], [logp])), {"profile": "off"})
    loaded = load_reference(path, key)
    assert loaded is not None
    (results, ref), summary = loaded
    assert results == [result] and summary == {"profile": "off"}
    assert torch.equal(ref.ids[0], ids[:2]) and torch.equal(ref.logp[0], logp[:2])  # the forced length
    assert load_reference(path, key | {"dtype": "torch.float32"}) is None
    assert load_reference(tmp_path / "none.pt", key) is None
