"""deploy/prometheus/alerts.yml and deploy/grafana/crucible.json read only what the web
exports: each expression's metrics, selector labels and ``by (...)`` labels are checked
against a live /metrics scrape (the expressions' names with regular expressions). promtool
checks the rules file and runs its unit tests (deploy/prometheus/alerts.test.yml: each rule
fires on series shaped like the scrape, after its ``for:``, and not below its threshold)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from apps.core import telemetry
from apps.scheduling.models import Node
from tests.factories import make_run

ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "deploy/prometheus/alerts.yml"
DASHBOARD = ROOT / "deploy/grafana/crucible.json"
RULE_TESTS = ROOT / "deploy/prometheus/alerts.test.yml"
PROMTOOL = Path("/opt/crucible/prometheus/promtool")  # scripts/install_test_deps.sh
#: Series Prometheus itself makes (not the app's): the alert state, the scrape's health.
BUILTIN = {"ALERTS", "up"}
#: PromQL words that are followed by "(" or are keywords, never metric names.
_SELECTOR = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_CRUCIBLE = re.compile(r"\bcrucible_[a-zA-Z0-9_:]*")
_BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


@pytest.fixture
def exported(project: Any, settings: Any) -> dict[str, set[str]]:
    """Every series name in a live scrape, with the label names its samples carry. A run,
    a node and a request first, and a zero child of each labelled counter, so each family
    has samples to read its labels from."""
    settings.CRUCIBLE = {**settings.CRUCIBLE, "METRICS_TOKEN": "scrape-secret-mon"}
    make_run(project)
    Node.objects.create(name="n1", pool="gpu", gpu_count=1,
                        last_heartbeat_at=timezone.now() - timedelta(seconds=3))
    telemetry.SANDBOX_FINISHED.labels("error", "none").inc(0)
    telemetry.METRIC_BATCHES.labels("duplicate").inc(0)
    Client().get("/healthz")
    response = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-secret-mon")
    assert response.status_code == 200
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def check_expression(expr: str, exported: dict[str, set[str]]) -> list[str]:
    """What in ``expr`` the scrape does not have: unknown series, unknown labels."""
    problems = []
    used = set(_CRUCIBLE.findall(expr))
    if not used:
        problems.append(f"{expr!r} reads no crucible_ series")
    for name in used - exported.keys():
        problems.append(f"{name} is not exported")
    for name, matchers in _SELECTOR.findall(expr):
        if name in BUILTIN or name not in exported:
            if name not in BUILTIN and name not in used:
                problems.append(f"{name} is neither exported nor a Prometheus series")
            continue
        for label in _MATCHER.findall(matchers):
            if label not in exported[name]:
                problems.append(f"{name} has no label {label!r} ({sorted(exported[name])})")
    labels = set().union(*(exported.get(n, set()) for n in used))
    for group in _BY.findall(expr):
        for label in (x.strip() for x in group.split(",") if x.strip()):
            if label not in labels:
                problems.append(f"by ({label}) in {expr!r}: no such label on {sorted(used)}")
    return problems


def test_the_checker_catches_wrong_names_and_labels() -> None:
    exported = {"crucible_nodes": {"pool", "state"}}
    assert check_expression('sum by (pool) (crucible_nodes{state="lost"})', exported) == []
    assert check_expression("crucible_node > 0", exported) == ["crucible_node is not exported"]
    assert "no label 'status'" in check_expression('crucible_nodes{status="x"}', exported)[0]
    assert "by (team)" in check_expression("sum by (team) (crucible_nodes)", exported)[0]
    assert check_expression("up == 0", exported) == ["'up == 0' reads no crucible_ series"]


def test_prometheus_rules_read_only_exported_series(exported: dict[str, set[str]]) -> None:
    document = yaml.safe_load(RULES.read_text())
    rules = [rule for group in document["groups"] for rule in group["rules"]]
    assert len(rules) >= 10
    alerts = [rule["alert"] for rule in rules]
    assert len(alerts) == len(set(alerts)), "alert names are unique"
    problems = []
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert rule["annotations"]["summary"]
        assert expr_balanced(rule["expr"]), rule["alert"]
        problems += [f"{rule['alert']}: {p}" for p in check_expression(rule["expr"], exported)]
    assert problems == []
    # The platform-level conditions the issue names have a rule each.
    text = RULES.read_text()
    for series in ("crucible_nodes", "crucible_queue_oldest_wait_seconds",
                   "crucible_sandbox_executions_finished_total",
                   "crucible_run_heartbeat_age_max_seconds"):
        assert series in text


def test_grafana_dashboard_reads_only_exported_series(exported: dict[str, set[str]]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] == "Crucible"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 10
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    problems = []
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
        for target in panel["targets"]:
            expr = target["expr"].replace("$pool", "gpu")
            assert expr_balanced(expr), panel["title"]
            problems += [f"{panel['title']}: {p}" for p in check_expression(expr, exported)]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            problems += check_expression(variable["definition"], exported)
    assert problems == []


def expr_balanced(expr: str) -> bool:
    depth = {"(": 0, "{": 0, "[": 0}
    closing = {")": "(", "}": "{", "]": "["}
    for ch in expr:
        if ch in depth:
            depth[ch] += 1
        elif ch in closing:
            depth[closing[ch]] -= 1
            if depth[closing[ch]] < 0:
                return False
    return not any(depth.values())


def test_promtool_checks_the_rules_and_passes_their_unit_tests() -> None:
    promtool = shutil.which("promtool") or (str(PROMTOOL) if PROMTOOL.exists() else None)
    if promtool is None:
        pytest.skip("promtool missing: run scripts/install_test_deps.sh as root (it takes "
                    "promtool out of Debian's prometheus package)")
    for args in (["check", "rules", str(RULES)], ["test", "rules", str(RULE_TESTS)]):
        done = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120,
                              cwd=RULES.parent)
        assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout
