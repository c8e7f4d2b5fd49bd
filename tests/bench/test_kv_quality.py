"""The KV quality benchmark's profiles are engine settings the engine knows (a misspelt key would
be ignored by the configuration, and the profile would silently run uncompressed)."""

from __future__ import annotations

from pathlib import Path

from bench.kv_quality import PROFILES
from engine import EngineConfig


def test_every_profile_names_only_engine_settings_and_builds_a_configuration() -> None:
    for name, settings in PROFILES.items():
        assert set(settings) <= set(EngineConfig.model_fields), name
        config = EngineConfig(model_path=Path("unused"), **settings)
        assert config.quantising or config.pruning or not settings.get("kv_compression"), name
