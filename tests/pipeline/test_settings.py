from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.settings import SettingsError, as_env, child_env, load_settings, unknown_variables


def test_reads_the_articles_switches_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYNAMIC_BATCHING", "true")
    monkeypatch.setenv("KV_COMPRESSION", "1")
    monkeypatch.setenv("MAX_BATCH_SIZE", "6")
    settings = load_settings()
    assert (settings.dynamic_batching, settings.kv_compression, settings.max_batch_size) == (True, True, 6)


def test_int8_layers_int6_layers_and_int6_parts_are_read_as_comma_separated_lists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KV_INT8_LAYERS", "16, 9,11")
    monkeypatch.setenv("KV_INT6_LAYERS", "3,1")
    monkeypatch.setenv("KV_INT6_PARTS", "11.1.v, 2.0.k")
    settings = load_settings()
    assert settings.kv_int8_layers == (9, 11, 16) and settings.kv_int6_layers == (1, 3)
    assert settings.kv_int6_parts == ("2.0.k", "11.1.v")


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
        ("KV_INT8_LAYERS", "[9,11]"),
        ("KV_INT8_LAYERS", "9,9"),
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


def test_sasl_without_credentials_is_refused_before_anything_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("KAFKA_SASL_USERNAME", "worker")
    with pytest.raises(SettingsError, match="needs KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD"):
        load_settings()
    monkeypatch.setenv("KAFKA_SASL_PASSWORD", "a-password")
    assert load_settings().kafka_security_protocol == "SASL_SSL"


def test_a_missing_ca_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"KAFKA_SSL_CAFILE=.*is not a file"):
        load_settings(kafka_security_protocol="SSL", kafka_ssl_cafile=tmp_path / "ca.pem")


def test_near_misses_of_setting_names_and_a_project_prefix_are_warned_about() -> None:
    warnings = unknown_variables(
        {"KV_COMPRESION": "true", "DEEPANALYZE_MODEL_PATH": "/m", "KV_COMPRESSION": "true", "PATH": "/bin",
         "KAFKA_HEAP_OPTS": "-Xmx1G", "EMBEDDED_BROKER": "kafka"}
    )  # fmt: skip
    assert warnings == [
        "DEEPANALYZE_MODEL_PATH is not read (settings have no prefix: MODEL_PATH?)",
        "KV_COMPRESION is not read (did you mean KV_COMPRESSION?)",
    ]


def test_settings_written_as_environment_variables_read_back_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Workers started by tests and benchmarks get their settings as variables (`as_env`)."""
    monkeypatch.setenv("KV_INT8_LAYERS", "9,11")
    monkeypatch.setenv("HTTP_ALLOWED_HOSTS", "a.example.com,b.example.com")
    settings = load_settings()
    for name in ("kv_int8_layers", "http_allowed_hosts", "kv_compression"):
        monkeypatch.setenv(name.upper(), as_env(getattr(settings, name)))
    again = load_settings()
    assert (again.kv_int8_layers, again.http_allowed_hosts) == ((9, 11), ("a.example.com", "b.example.com"))
    monkeypatch.setenv("KV_INT8_LAYERS", as_env(()))
    assert load_settings().kv_int8_layers == ()


def test_a_child_given_child_env_loads_exactly_the_parents_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the tests' and benchmarks' workers start with: every setting, a secret in clear, and
    the parent's own variable for a setting replaced, not kept beside it."""
    monkeypatch.setenv("KV_INT8_LAYERS", "9,11")
    monkeypatch.setenv("KAFKA_SASL_PASSWORD", "s3cret")
    settings = load_settings(max_batch_size=3)
    env = child_env(settings, {"MAX_BATCH_SIZE": "7", "HOME": "/home/x"})
    secret = "s3cret"  # noqa: S105 - a test value
    assert (env["MAX_BATCH_SIZE"], env["HOME"], env["KAFKA_SASL_PASSWORD"]) == ("3", "/home/x", secret)
    for name in list(os.environ):
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert load_settings() == settings
