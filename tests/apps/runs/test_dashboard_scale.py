"""The runs table with 10,000 runs: the same number of queries as with ten, and the
server-side render time printed (no timing assertion: the machine is shared and noisy).

Run it alone to read the figures:
``pytest tests/apps/runs/test_dashboard_scale.py -q -s -p no:cacheprovider``
"""

from __future__ import annotations

import statistics
import time

from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from apps.core.actor import Actor
from apps.environments import services as env_services
from apps.runs.models import Run, RunKind, RunStatus

N_RUNS = 10_000
REPEATS = 5


def seed_runs(project, n: int, users: list, env_version) -> None:
    """``n`` runs spread over kinds, statuses, creators and (half of them) an environment,
    inserted in bulk (a launch through the service is not what is measured here)."""
    kinds, statuses = RunKind.values, RunStatus.values
    rows = [
        Run(team=project.team, project=project, name=f"seed-{i:05d}", kind=kinds[i % len(kinds)],
            status=statuses[i % len(statuses)], config={"trainer": {"steps": i % 50}},
            pool="cpu", priority=i % 7 - 3, created_by=users[i % len(users)],
            environment_version=env_version if i % 2 else None)
        for i in range(n)
    ]
    Run.objects.bulk_create(rows, batch_size=1000)
    # A database that has been running has statistics on its tables (autovacuum does it on
    # PostgreSQL); without them the planner takes 10,000 runs for 5 and joins before it sorts.
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {Run._meta.db_table}")


def measure(client: Client, url: str, **headers: str) -> tuple[float, float, int]:
    """Median render time and median time in SQL (ms), and the query count of one render."""
    times, sql = [], []
    queries = 0
    for _ in range(REPEATS):
        with CaptureQueriesContext(connection) as ctx:
            started = time.perf_counter()
            response = client.get(url, **headers)
            times.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200
        queries = len(ctx.captured_queries)
        sql.append(sum(float(q["time"]) for q in ctx.captured_queries) * 1000)
    return statistics.median(times), statistics.median(sql), queries


def test_runs_table_with_10k_runs(member, make_caller, team, project):
    others = [make_caller(team, username=f"u{i}").user for i in range(3)]
    env = env_services.environment_create(actor=Actor.system(), team=team, project=project,
                                          slug="arith")
    version, _ = env_services.version_create(actor=Actor.system(), environment=env,
                                             spec={"task": "a"})
    client = Client()
    client.force_login(member.user)
    seed_runs(project, 10, [member.user, *others], version)
    *_, small_queries = measure(client, "/t/acme/")

    started = time.perf_counter()
    seed_runs(project, N_RUNS - 10, [member.user, *others], version)
    seeded_s = time.perf_counter() - started
    pages = {
        "first page": ("/t/acme/", {}),
        "sorted by name, page 100": ("/t/acme/?sort=name&page=100", {}),
        "filtered kind+status+env+creator": (
            "/t/acme/?kind=train&status=running&environment=arith&creator=u0", {}),
        "htmx partial, last page": (
            "/t/acme/?page=200", {"HTTP_HX_REQUEST": "true", "HTTP_HX_TARGET": "runs"}),
    }
    print(f"\nseeded {N_RUNS} runs in {seeded_s:.1f}s ({connection.vendor})")
    for label, (url, headers) in pages.items():
        ms, sql_ms, queries = measure(client, url, **headers)
        print(f"runs-table render ({label}): crucible={ms:.1f}ms sql={sql_ms:.1f}ms "
              f"queries={queries}")
        if not headers:
            assert queries <= small_queries, label  # an empty page skips the rows query
