from __future__ import annotations

import httpx
import pytest

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
    service = Service(load_settings(), ScriptedEngine(model_id="m-1"), telemetry)
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
