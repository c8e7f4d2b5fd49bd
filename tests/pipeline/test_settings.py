from __future__ import annotations

import pytest

from pipeline.settings import SettingsError, load_settings


def test_reads_the_articles_switches_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYNAMIC_BATCHING", "true")
    monkeypatch.setenv("KV_COMPRESSION", "1")
    monkeypatch.setenv("MAX_BATCH_SIZE", "6")
    settings = load_settings()
    assert (settings.dynamic_batching, settings.kv_compression, settings.max_batch_size) == (True, True, 6)


def test_defaults_match_the_article(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DYNAMIC_BATCHING", "KV_COMPRESSION", "MAX_BATCH_SIZE", "STATUS_PORT"):
        monkeypatch.delenv(name, raising=False)
    settings = load_settings()
    assert (settings.dynamic_batching, settings.kv_compression, settings.max_batch_size) == (False, False, 8)
    assert settings.status_port == 3000 and settings.status_host == "127.0.0.1"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MAX_BATCH_SIZE", "0"),
        ("MAX_BATCH_SIZE", "eight"),
        ("DYNAMIC_BATCHING", "maybe"),
        ("KAFKA_BOOTSTRAP_SERVERS", "no-port"),
        ("STATUS_PORT", "70000"),
        ("KV_QUANT_BITS", "12"),
        ("KV_KEEP_RATIO", "0"),
    ],
)
def test_invalid_values_name_the_variable(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=name):
        load_settings()


def test_an_answer_longer_than_the_longest_request_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAX_MODEL_LEN", "2048")
    monkeypatch.setenv("MAX_NEW_TOKENS", "2048")
    with pytest.raises(SettingsError, match="MAX_NEW_TOKENS"):
        load_settings()


def test_secrets_are_not_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_SASL_PASSWORD", "hunter2")
    settings = load_settings()
    assert "hunter2" not in repr(settings) and "hunter2" not in str(settings.model_dump())
