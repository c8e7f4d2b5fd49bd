"""The service's configuration: read once from the environment, validated, never written back.

Every knob is an environment variable named after its field in upper case (`MAX_BATCH_SIZE`,
`KAFKA_BOOTSTRAP_SERVERS`, ...). Invalid values stop the service at start with a message that
names the variable.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from engine.config import EngineConfig, EngineOptions
from pipeline.kinds import read_kinds
from schemas.kinds import KindSpec, built_in_kinds


class SettingsError(ValueError):
    """The environment holds an invalid value; the message names the variable."""


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "deepanalyze"


def as_env(value: object) -> str:
    """A setting's value written as its environment variable is read back: booleans in lower case,
    lists of values (KV_INT8_LAYERS, HTTP_ALLOWED_HOSTS) comma-separated."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def child_env(settings: Settings, parent: Mapping[str, str]) -> dict[str, str]:
    """The environment of a child process that loads exactly `settings`: `parent` minus anything
    `settings` sets, plus every setting as its variable (secrets included, in clear: the child
    needs them; they never reach a log)."""
    values = settings.model_dump()
    env = {k: v for k, v in parent.items() if k.lower() not in values}
    for name, value in values.items():
        if value is None or isinstance(value, dict | list):
            continue
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        env[name.upper()] = as_env(value)
    return env


class Settings(BaseSettings, EngineOptions):
    model_config = SettingsConfigDict(env_prefix="", case_sensitive=False, extra="ignore", frozen=True)

    # Kafka
    kafka_bootstrap_servers: str = "127.0.0.1:9092"
    kafka_client_id: str = "deepanalyze"
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    kafka_ssl_cafile: Path | None = None
    # The answers' producer is idempotent: a send retried after a lost acknowledgement is not
    # written twice. Off only for brokers without idempotent producers (the Tansu emulator).
    kafka_enable_idempotence: bool = True
    topic_complaints: str = "docs.complaints"
    topic_meeting_notes: str = "docs.meeting-notes"
    topic_filings: str = "docs.filings"
    kinds_file: Path | None = Field(
        default=None, description="TOML file of further document kinds (deploy/kinds.example.toml)."
    )
    topic_analysis: str = "analysis.events"
    topic_dead_letters: str = "analysis.dlq"
    topic_progress: str = Field(
        default="analysis.progress",
        description="Analyses as they are written, for the pages (documents sent with the progress header).",
    )
    topic_partitions: int = Field(default=3, ge=1, le=1024)
    topic_replication_factor: int = Field(default=1, ge=1, le=16)
    consumer_group: str = "deepanalyze"
    session_timeout_ms: int = Field(default=10_000, ge=1_000)
    max_poll_records: int = Field(default=64, ge=1)
    fetch_max_wait_ms: int = Field(
        default=50, ge=1, le=10_000, description="Longest a fetch waits at the broker for new records."
    )
    max_inflight: int = Field(default=32, ge=1, description="Documents consumed but not yet answered.")
    commit_interval_ms: int = Field(default=1_000, ge=50)
    processing_guarantee: Literal["at_least_once", "exactly_once"] = Field(
        default="at_least_once",
        description=(
            "exactly_once: each answer and its consumed offset are committed in one Kafka transaction "
            "(read the answer topics with isolation.level=read_committed)."
        ),
    )
    transactional_id_prefix: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="exactly_once: prefix of the per-partition transactional ids (default: CONSUMER_GROUP).",
    )
    shutdown_grace_s: float = Field(
        default=30.0, ge=0, le=3_600, description="On SIGTERM: time in-flight documents get to finish."
    )
    shutdown_close_s: float = Field(
        default=10.0, gt=0, le=600, description="On SIGTERM, after the grace: time to commit and close."
    )
    cluster_check_interval_s: float = Field(
        default=10.0, gt=0, le=3_600, description="How often topics, partitions and lag are looked at."
    )
    broker_wait_s: float = Field(
        default=60.0, gt=0, le=3_600, description="How long start-up waits for Kafka."
    )

    # Model and engine: the article's three switches, plus where the model lives.
    model_path: Path | None = None  # None: the bundled MODEL, converted once into the cache
    # The bundled models of `pipeline.bundled_models.MODELS` (listed here so that reading the settings does
    # not import torch; a test keeps the two lists equal). MODEL_PATH, when set, wins.
    model: Literal["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"] = Field(
        default="qwen2.5-coder-0.5b",
        description="Bundled model when MODEL_PATH is unset; qwen2.5-coder-1.5b needs `make model-large`.",
    )
    model_cache_dir: Path = Field(default_factory=default_cache_dir)
    # Which model answers: our engine in this process (the settings above and the engine's knobs
    # below), or an OpenAI-compatible server (vLLM, llama-server, Ollama, TGI) at OPENAI_BASE_URL.
    analyzer_backend: Literal["embedded", "openai"] = Field(
        default="embedded", description="embedded: our engine, in process; openai: OPENAI_BASE_URL."
    )
    openai_base_url: str | None = Field(
        default=None, description="The server's API root, e.g. http://127.0.0.1:8080/v1."
    )
    openai_api_key: SecretStr | None = Field(default=None, description="Its bearer token, if it wants one.")
    openai_model: str | None = Field(
        default=None, description="The model name sent; default: the first the server lists."
    )
    openai_timeout_s: float = Field(default=300.0, gt=0, le=3_600, description="One request's limit.")
    openai_retries: int = Field(
        default=8, ge=0, le=20, description="Retries of a request the server refused for now or lost."
    )
    openai_json_schema: bool = Field(
        default=True,
        description="Send the answer's JSON Schema as response_format (off for servers without it).",
    )
    # The engine's knobs (DYNAMIC_BATCHING, MAX_BATCH_SIZE, KV_COMPRESSION, ...) are the fields
    # of `EngineOptions`, inherited: declared and validated in one place, the engine's.
    max_new_tokens: int = Field(default=1024, ge=16, le=8192)
    max_document_chars: int = Field(default=8_000, ge=1)
    dead_letter_max_value_bytes: int = Field(
        default=512 * 1024,
        ge=0,
        le=64 * 1024 * 1024,
        description="Original bytes a dead letter carries whole.",
    )
    max_message_bytes: int = Field(
        default=1_000_000,
        ge=64 * 1024,
        le=64 * 1024 * 1024,
        description="Largest answer record written: below the answer topics' max.message.bytes.",
    )
    generation_attempts: int = Field(default=2, ge=1, le=5, description="1 + the repair attempt.")
    urgency_from: Literal["rules", "model"] = Field(
        default="rules", description="Complaints' urgency: the written criteria, or the model's answer."
    )
    polarity_from: Literal["probe", "question"] = Field(
        default="probe",
        description="probe: read from the model's hidden state where the model has a probe; question: asked.",
    )
    polarity_parts: int = Field(
        default=1,
        ge=1,
        le=8,
        description="The probe reads this many contiguous parts of a document, cut at sentence ends, and "
        "decides by their length-weighted mean (one appended sentence is outweighed); 1: the whole (the "
        "default: 3 parts cost 2.3 points of polarity, 4.3 on Chinese news, and half the label rate).",
    )
    polarity_guard_parts: int = Field(
        default=3,
        ge=1,
        le=8,
        description="With a probe, a complaint read positive is also read in this many parts apart, and is "
        "negative where a part reads clearly negative (text appended to steer it positive is read on its "
        "own); 1: no check.",
    )
    polarity_probe: Path | None = Field(
        default=None,
        description="A probe file for MODEL_PATH (`python -m bench.probe`); bundled models have theirs.",
    )

    # Status server (pages, API, /metrics, /healthz). Beyond loopback it needs HTTP_TOKEN: see
    # `_token_beyond_loopback`. HTTP_TOKEN comes first so that STATUS_HOST's validator can see it.
    http_token: SecretStr | None = Field(
        default=None, description="Bearer token for every route but /healthz; required beyond loopback."
    )
    status_host: str = Field(default="127.0.0.1", validate_default=True)
    status_port: int = Field(default=3000, ge=0, le=65535)
    http_allowed_hosts: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(),
        description="Host header names served besides loopback and STATUS_HOST (comma-separated; "
        "'*.example.com' a domain, '*' any). Others: 400.",
    )
    http_max_body_bytes: int | None = Field(
        default=None,
        ge=1024,
        le=64 * 1024 * 1024,
        description="Largest request body (413); default: 6 bytes a MAX_DOCUMENT_CHARS character + 16 KiB.",
    )
    http_header_timeout_s: float = Field(
        default=10.0, gt=0, le=300, description="A connection's request headers must arrive within this."
    )
    http_body_timeout_s: float = Field(
        default=30.0, gt=0, le=3_600, description="A request's whole body must arrive within this (408)."
    )
    http_keep_alive_s: int = Field(default=5, ge=1, le=600, description="An idle connection is closed after.")

    # Telemetry, by the OpenTelemetry SDK's variables: traces are exported when either endpoint is
    # set (the exporter itself reads them, and OTEL_EXPORTER_OTLP_HEADERS, ..._TIMEOUT, ...), over the
    # protocol named (the traces' own variable first).
    otel_service_name: str = "deepanalyze"
    otel_exporter_otlp_endpoint: str | None = None
    otel_exporter_otlp_traces_endpoint: str | None = None
    otel_exporter_otlp_protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    otel_exporter_otlp_traces_protocol: Literal["http/protobuf", "grpc"] | None = None

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @field_validator("kafka_bootstrap_servers")
    @classmethod
    def _servers_not_empty(cls, value: str) -> str:
        servers = [s.strip() for s in value.split(",") if s.strip()]
        if not servers:
            raise ValueError("needs at least one host:port")
        for server in servers:
            host, sep, port = server.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"{server!r} is not host:port")
        return ",".join(servers)

    def engine_config(self, model_path: Path) -> EngineConfig:
        """The engine's configuration: these settings' engine options and the model found."""
        return EngineConfig.of(self, model_path)

    @cached_property
    def kinds(self) -> dict[str, KindSpec]:
        """The kinds served: the three built in, on TOPIC_*, and KINDS_FILE's (checked at start)."""
        built_in = built_in_kinds(self.topic_complaints, self.topic_meeting_notes, self.topic_filings)
        answers = (self.topic_analysis, self.topic_dead_letters, self.topic_progress)
        return read_kinds(self.kinds_file, built_in, answers)

    @property
    def input_topics(self) -> dict[str, str]:
        """Each input topic and the kind its plain-text documents default to."""
        return {spec.topic: name for name, spec in self.kinds.items()}

    def topic_for(self, kind: str) -> str:
        return self.kinds[kind].topic

    @property
    def all_topics(self) -> list[str]:
        return [*self.input_topics, self.topic_analysis, self.topic_dead_letters, self.topic_progress]

    @field_validator("http_allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(name.strip().lower() for name in value.split(",") if name.strip())
        return value

    @field_validator("max_new_tokens")
    @classmethod
    def _answer_within_the_longest_request(cls, value: int, info: ValidationInfo) -> int:
        limit = info.data.get("max_model_len")  # absent when MAX_MODEL_LEN itself was invalid
        if limit is not None and value >= limit:
            raise ValueError(f"must be below MAX_MODEL_LEN ({limit}), which counts the prompt too")
        return value

    @field_validator("status_host")
    @classmethod
    def _token_beyond_loopback(cls, value: str, info: ValidationInfo) -> str:
        # Checked on STATUS_HOST rather than on HTTP_TOKEN: load_settings shows the rejected input,
        # which here is the address, never the secret.
        if "http_token" not in info.data:  # HTTP_TOKEN itself was invalid; reported on its own
            return value
        token: SecretStr | None = info.data["http_token"]
        if token is not None and len(token.get_secret_value()) < 16:  # guessable
            raise ValueError("HTTP_TOKEN is shorter than 16 characters (make one: `openssl rand -hex 32`)")
        if token is None and not cls.is_loopback(value):
            raise ValueError(
                f"{value} is beyond loopback: set HTTP_TOKEN (a secret bearer token every route but "
                "/healthz then requires), or STATUS_HOST=127.0.0.1"
            )
        return value

    @model_validator(mode="after")
    def _kafka_security_complete(self) -> Settings:
        # Checked here, before any model or pool is loaded, not by the Kafka client at connect time.
        protocol = self.kafka_security_protocol
        if protocol.startswith("SASL") and (
            self.kafka_sasl_username is None or self.kafka_sasl_password is None
        ):
            raise ValueError(
                f"KAFKA_SECURITY_PROTOCOL={protocol} needs KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD"
            )
        if self.kafka_ssl_cafile is not None and not self.kafka_ssl_cafile.is_file():
            raise ValueError(f"KAFKA_SSL_CAFILE={self.kafka_ssl_cafile} is not a file")
        return self

    @model_validator(mode="after")
    def _kinds_readable(self) -> Settings:
        _ = self.kinds  # read and checked now: a bad file stops the worker at start, not at a document
        return self

    @model_validator(mode="after")
    def _probe_readable(self) -> Settings:
        if self.polarity_probe is not None:
            if self.analyzer_backend != "embedded":
                raise ValueError("POLARITY_PROBE reads hidden states: it needs ANALYZER_BACKEND=embedded")
            if not self.polarity_probe.is_file():
                raise ValueError(f"POLARITY_PROBE={self.polarity_probe} is not a file")
        return self

    @model_validator(mode="after")
    def _backend_complete(self) -> Settings:
        if self.analyzer_backend == "openai":
            url = self.openai_base_url
            if url is None:
                raise ValueError(
                    "ANALYZER_BACKEND=openai needs OPENAI_BASE_URL (e.g. http://127.0.0.1:8080/v1)"
                )
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"OPENAI_BASE_URL={url} is not an http:// or https:// address")
        return self

    @staticmethod
    def is_loopback(host: str) -> bool:
        """Whether `host` (an address or name, IPv6 with or without brackets) reaches this machine only."""
        if host.lower().rstrip(".") == "localhost":
            return True
        try:
            return ipaddress.ip_address(host.strip("[]")).is_loopback
        except ValueError:
            return False


# Variables the project reads besides the settings (pipeline/broker.py, pipeline/kafka_broker.py).
OTHER_VARIABLES = frozenset({"EMBEDDED_BROKER", "KAFKA_LIBS"})


def unknown_variables(environ: dict[str, str] | os._Environ[str]) -> list[str]:
    """Warnings for variables that look meant for this project and are not read: a near miss of a
    setting's name (`KV_COMPRESION`), or any name beginning with DEEPANALYZE_ (there is no prefix)."""
    known = {name.upper() for name in Settings.model_fields} | OTHER_VARIABLES
    warnings = []
    for name in sorted(environ):
        upper = name.upper()
        if upper in known:
            continue
        if upper.startswith("DEEPANALYZE_"):
            warnings.append(
                f"{name} is not read (settings have no prefix: {upper.removeprefix('DEEPANALYZE_')}?)"
            )
        elif close := difflib.get_close_matches(upper, known, n=1, cutoff=0.9):
            warnings.append(f"{name} is not read (did you mean {close[0]}?)")
    return warnings


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment (plus explicit overrides), or a SettingsError naming the variable."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            name = str(err["loc"][0]).upper() if err["loc"] else "(settings)"
            shown = "" if "PASSWORD" in name else f" (got {err.get('input')!r})"
            problems.append(f"{name}: {err['msg']}{shown}")
        raise SettingsError("invalid configuration:\n  " + "\n  ".join(problems)) from None
