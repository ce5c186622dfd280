"""Several web processes, one /metrics: with PROMETHEUS_MULTIPROC_DIR each process writes its
counters to that folder and any process's scrape reports the sum (prometheus-client's
multiprocess mode, which docs/operations.md tells deployments to set up)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[3]

INGEST = """
from apps.core import telemetry
telemetry.METRIC_POINTS.inc({n})
telemetry.REQUEST_LATENCY.labels("healthz", "GET", "2xx").observe(0.01)
"""

SCRAPE = """
from prometheus_client import generate_latest
from apps.core import telemetry
print(generate_latest(telemetry.exposition_registry()).decode())
"""


def run(code: str, env: dict[str, str]) -> str:
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True,
                          capture_output=True, text=True, timeout=120).stdout


def test_counters_of_several_processes_add_up(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
           "DJANGO_SETTINGS_MODULE": "config.settings"}
    run(INGEST.format(n=5), env)
    run(INGEST.format(n=7), env)
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for family in text_string_to_metric_families(run(SCRAPE, env))
              for s in family.samples}
    assert values[("crucible_metric_points_ingested_total", ())] == 12
    assert values[("crucible_http_request_duration_seconds_count",
                   (("method", "GET"), ("status", "2xx"), ("view", "healthz")))] == 2
