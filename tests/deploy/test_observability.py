"""Offline checks of the monitoring in deploy/: Prometheus' scrape and alert rules, Grafana's
provisioning and dashboard, wired to each other and to the compose stack. That every series and
label they query exists is checked against a running worker's scrape in
tests/pipeline/test_service.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import promql_parser
import yaml

from pipeline.settings import Settings
from tests.deploy.promql import ALERTS, DASHBOARD, DEPLOY, queries, reads

COMPOSE = DEPLOY / "compose.yaml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
GRAFANA = DEPLOY / "grafana" / "provisioning"


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _mounts(service: dict[str, Any]) -> dict[str, Path]:
    """A compose service's bind mounts: container path -> host path (resolved from deploy/)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target, *_ = str(volume).split(":")
        if source.startswith("."):
            mounts[target] = (DEPLOY / source).resolve()
    return mounts


def test_every_query_parses_as_promql() -> None:
    found = queries()
    assert len(found) >= 15
    for where, expr in found.items():
        promql_parser.parse(expr)  # raises on a syntax error
        assert reads(expr), f"{where} reads no series"


def test_the_dashboard_shows_what_an_operator_asks_first() -> None:
    read = {r.metric for expr in queries().values() for r in reads(expr)}
    wanted = {
        "throughput": "deepanalyze_documents_total",
        "latency": "deepanalyze_document_duration_seconds_bucket",
        "time to first token": "deepanalyze_time_to_first_token_seconds_bucket",
        "time per output token": "deepanalyze_time_per_output_token_seconds_bucket",
        "tokens": "deepanalyze_tokens_total",
        "batch size": "deepanalyze_engine_batch_size_bucket",
        "queue": "deepanalyze_engine_queue_depth",
        "KV pool": "deepanalyze_kv_pool_used_bytes",
        "lag": "deepanalyze_consumer_lag",
        "dead letters": "deepanalyze_dead_letters_total",
    }
    missing = {what: metric for what, metric in wanted.items() if metric not in read}
    assert not missing, missing
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    dead = next(p for p in dashboard["panels"] if "deepanalyze_dead_letters_total" in p["targets"][0]["expr"])
    assert any(r.metric.endswith("dead_letters_total") and "reason" in r.labels
               for t in dead["targets"] for r in reads(t["expr"]))  # fmt: skip


def test_alert_rules_cover_lag_dead_letters_and_no_progress_and_say_what_to_do() -> None:
    rules = [rule for group in _yaml(ALERTS)["groups"] for rule in group["rules"]]
    names = {rule["alert"] for rule in rules}
    for wanted in ("LagGrowing", "DeadLettersSpiking", "NoProgress", "WorkerDown"):
        assert f"DeepAnalyze{wanted}" in names
    for rule in rules:
        assert rule["for"] and rule["labels"]["severity"] in {"page", "warn"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_the_dashboard_reads_the_provisioned_prometheus_and_is_provisioned_from_its_folder() -> None:
    services = _yaml(COMPOSE)["services"]
    (source,) = _yaml(GRAFANA / "datasources" / "prometheus.yaml")["datasources"]
    uids = {
        target["datasource"]["uid"]
        for panel in json.loads(DASHBOARD.read_text(encoding="utf-8"))["panels"]
        for target in panel["targets"]
    }
    assert uids == {source["uid"]}
    assert source["url"] == "http://prometheus:9090" and "prometheus" in services
    grafana = _mounts(services["grafana"])
    assert grafana["/etc/grafana/provisioning"] == GRAFANA.resolve()
    (provider,) = _yaml(GRAFANA / "dashboards" / "deepanalyze.yaml")["providers"]
    assert grafana[provider["options"]["path"]] == DASHBOARD.parent.resolve()


def test_prometheus_scrapes_the_worker_with_its_token_and_loads_the_rules() -> None:
    services = _yaml(COMPOSE)["services"]
    config = _yaml(PROMETHEUS)
    mounts = _mounts(services["prometheus"])
    for rule_file in config["rule_files"]:
        assert mounts[rule_file] == ALERTS.resolve()
    assert mounts[services["prometheus"]["command"][0].split("=", 1)[1]] == PROMETHEUS.resolve()
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "deepanalyze"  # the job="deepanalyze" the dashboard and alerts select
    (target,) = job["static_configs"][0]["targets"]
    host, port = target.split(":")
    worker = services[host]
    assert int(port) == Settings.model_fields["status_port"].default
    assert host in worker["environment"]["HTTP_ALLOWED_HOSTS"].split()  # the Host header it sends
    secret = job["authorization"]["credentials_file"]
    assert secret == "/run/secrets/" + services["prometheus"]["secrets"][0]
    assert _yaml(COMPOSE)["secrets"][services["prometheus"]["secrets"][0]] == {"environment": "HTTP_TOKEN"}
