from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from engine import Engine, SamplingParams
from engine.tiny import build_tiny
from pipeline.app import engine_config
from pipeline.http import serve_status
from pipeline.service import Service
from pipeline.settings import load_settings
from pipeline.telemetry import Telemetry
from tests.pipeline.fakes import ScriptedEngine


@pytest.mark.parametrize(("dynamic", "kv", "size"), [("true", "true", "5"), ("false", "false", "8")])
async def test_status_reflects_the_environment(
    monkeypatch: pytest.MonkeyPatch, telemetry: Telemetry, dynamic: str, kv: str, size: str
) -> None:
    monkeypatch.setenv("DYNAMIC_BATCHING", dynamic)
    monkeypatch.setenv("KV_COMPRESSION", kv)
    monkeypatch.setenv("MAX_BATCH_SIZE", size)
    service = Service(load_settings(), ScriptedEngine(model_id="m-1", kv_compression=kv == "true"), telemetry)
    async with serve_status(service.status, "127.0.0.1", 0) as port, httpx.AsyncClient() as client:
        status = (await client.get(f"http://127.0.0.1:{port}/api/status")).json()
        health = await client.get(f"http://127.0.0.1:{port}/healthz")
    assert status["dynamic_batching"] is (dynamic == "true")
    assert status["kv_compression"] is (kv == "true")
    assert status["max_batch_size"] == int(size)
    assert status["model"] == "m-1"
    assert {"processed", "failed", "dead_lettered"} <= status.keys()
    assert status["kv_pool"]["total_bytes"] == 1024
    assert "batch_occupancy" in status["engine"]
    assert health.status_code == 503  # not consuming yet
    assert status["grammars_ready"] is False


@pytest.mark.parametrize("kv", ["true", "false"])
async def test_kv_compression_switch_changes_status_and_the_engines_memory(
    monkeypatch: pytest.MonkeyPatch, telemetry: Telemetry, kv: str
) -> None:
    """KV_COMPRESSION reaches the real engine (tiny model): /api/status names the profile, and
    while a long prompt runs the pool holds fewer bytes per token than full precision."""
    monkeypatch.setenv("KV_COMPRESSION", kv)
    monkeypatch.setenv("KV_QUANT_BITS", "8")
    monkeypatch.setenv("KV_CACHE_BYTES", str(1 << 22))
    monkeypatch.setenv("DTYPE", "float32")
    settings = load_settings()
    engine = Engine(engine_config(settings, Path("unused")), build_tiny("qwen2"))
    service = Service(settings, engine, telemetry)
    ratios = []
    async with engine, serve_status(service.status, "127.0.0.1", 0) as port, httpx.AsyncClient() as client:
        prompt = engine.format_chat([{"role": "user", "content": "The invoice was wrong. " * 12}])
        handle = engine.submit(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
        while not handle.done:
            status = (await client.get(f"http://127.0.0.1:{port}/api/status")).json()
            if status["kv_pool"]["held_tokens"]:
                ratios.append(status["kv_pool"]["live_ratio"])
        await handle.result()
    assert status["kv_compression"] is (kv == "true")
    if kv == "true":
        profile = {"quant_bits": 8, "residual_tokens": 32, "sink_tokens": 4, "keep_ratio": 1.0}
        reader = status["kv_profile"].pop("reader")
        assert reader == engine.stats().kv_reader and reader.startswith(("native-", "torch"))
        assert status["kv_profile"] == profile | {"prune_policy": "attention"}
        assert min(ratios) < 0.8
    else:
        assert status["kv_profile"] is None
        assert min(ratios) >= 1.0
