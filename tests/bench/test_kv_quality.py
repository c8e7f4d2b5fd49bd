"""The KV quality benchmark's profiles are engine settings the engine knows (a misspelt key would
be ignored by the configuration, and the profile would silently run uncompressed)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from bench.kv_quality import (
    PROFILES,
    DocResult,
    Reference,
    load_reference,
    real_documents,
    reference_key,
    save_reference,
)
from bench.real_data import Labelled
from engine import Engine, EngineConfig


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
    """The key is the benchmark's own (torch's version as a plain string: the safe loader refuses
    its TorchVersion class, and every cached reference failed to load back)."""
    result = DocResult("d", "complaint", "zh", 3, "negative", 10, [1, 2, 3], 1.0, 0.5, True,
                       {"sentiment": {"polarity": "negative"}}, 100, 10, kl=[0.1], top1=[True])  # fmt: skip
    ids, logp = torch.arange(12, dtype=torch.int32).view(3, 4), torch.randn(3, 4)
    args = SimpleNamespace(
        model="m", max_batch=4, pool_mib=64, top_k=8, tf_tokens=2, prefix_caching=True, forced=True
    )
    key = reference_key(args, SimpleNamespace(dtype=torch.bfloat16), [{"document_id": "d"}])  # type: ignore[arg-type]
    path = tmp_path / "ref.pt"
    save_reference(path, key, ([result], Reference([ids], [logp])), {"profile": "off"})
    loaded = load_reference(path, key)
    assert loaded is not None
    (results, ref), summary = loaded
    assert results == [result] and summary == {"profile": "off"}
    assert torch.equal(ref.ids[0], ids[:2]) and torch.equal(ref.logp[0], logp[:2])  # the forced length
    assert load_reference(path, key | {"dtype": str(torch.float32)}) is None
    assert load_reference(tmp_path / "none.pt", key) is None


async def test_the_reference_is_recorded_in_the_pass_profiles_are_measured_in() -> None:
    """Measured against its own reference pass an unchanged engine gives KL 0 at every position,
    in a fresh engine too (batching order is the same in both passes); int4 moves the distributions.
    The forced prompts name the polarity the reference decided, and force its first tokens."""
    from bench.kv_forced import reference_pass, teacher_forced_pass
    from bench.kv_quality import analysis_forcing
    from engine.tiny import build_tiny

    tiny = build_tiny("qwen2")
    tiny.model.config.max_position_embeddings = 4096  # the narrative prompt, one character a token
    docs = [
        {"document_id": f"d{i}", "kind": kind, "language": "en", "text": text}
        for i, (kind, text) in enumerate([("complaint", "The parcel came late."), ("filing", "Revenue grew."),
                                          ("meeting_notes", "We agreed to ship on Monday.")])
    ]  # fmt: skip
    outputs = [[5 + i, 17, 42, 99, 3, 250, 7, 8, 11, 12, 40, 41] for i in range(len(docs))]
    analyses = [{"sentiment": {"polarity": "negative"}}, None, {"sentiment": {"polarity": "positive"}}]
    reference = [
        DocResult(d["document_id"], d["kind"], d["language"], len(d["text"]), None, 0, out, 0.0, 0.0, False,
                  analysis, 0, 0)
        for d, out, analysis in zip(docs, outputs, analyses, strict=True)
    ]  # fmt: skip

    def engine(**settings: object) -> Engine:
        config = EngineConfig(model_path=Path("unused"), dtype="float32", kv_cache_bytes=1 << 24, **settings)  # type: ignore[arg-type]
        return Engine(config, tiny)

    async with engine() as first:
        forcing = analysis_forcing(first, docs, reference, 10)
        ref = await reference_pass(first, forcing, top_k=8)
        again = await teacher_forced_pass(first, forcing, ref)
    assert [forced for _, forced in forcing] == [out[:10] for out in outputs]
    prompts = [first.decode(prompt) for prompt, _ in forcing]
    assert "negative" in prompts[0] and "neutral" in prompts[1] and "positive" in prompts[2]
    assert [r.shape for r in ref.ids] == [(10, 8)] * len(docs)
    assert all(kls == [0.0] * 10 and all(top1) for kls, top1 in again)
    async with engine() as fresh:
        assert all(kls == [0.0] * 10 for kls, _ in await teacher_forced_pass(fresh, forcing, ref))
    settings = {"kv_compression": True, "kv_quant_bits": 4, "kv_residual_tokens": 0, "kv_sink_tokens": 0}
    async with engine(**settings) as int4:
        moved = await teacher_forced_pass(int4, forcing, ref)
    assert max(k for kls, _ in moved for k in kls) > 0  # a tiny random model: small, never 0
