"""The PromQL the deploy files hold (the Grafana dashboard's panels, the alert rules), parsed with
`promql-parser`, and the series and labels each expression reads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import promql_parser
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "deepanalyze.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
# Series and labels Prometheus itself adds to a scrape: not in the worker's /metrics.
SCRAPE_SERIES = frozenset({"up"})
TARGET_LABELS = frozenset({"job", "instance"})


@dataclass(frozen=True)
class Read:
    """One series an expression selects, with the labels it matches on or groups by."""

    metric: str
    labels: frozenset[str]


def queries() -> dict[str, str]:
    """Every expression, by where it is: "panel <title> <refId>" or "alert <name>"."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    found = {
        f"panel {panel['title']} {target['refId']}": target["expr"]
        for panel in dashboard["panels"]
        for target in panel["targets"]
    }
    for group in yaml.safe_load(ALERTS.read_text(encoding="utf-8"))["groups"]:
        found |= {f"alert {rule['alert']}": rule["expr"] for rule in group["rules"]}
    return found


def reads(expr: str) -> list[Read]:
    """The series `expr` selects; an aggregation's `by` labels count as read from every series under it."""
    found: list[Read] = []

    def selectors(node: promql_parser.Expr) -> list[promql_parser.VectorSelector]:
        nodes: list[promql_parser.VectorSelector] = []

        def visit(n: object) -> None:
            if isinstance(n, promql_parser.VectorSelector):
                nodes.append(n)

        promql_parser.walk(node, visit)
        return nodes

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            matched = {m.name for m in node.matchers.matchers}
            found.append(Read(node.name, frozenset(matched)))
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            grouped = frozenset(node.modifier.labels)
            found.extend(Read(s.name, grouped) for s in selectors(node.expr))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found
