"""Concurrency and volume of metric ingest (issue 25, item 3, scaled down): client processes
(``tests.e2e.metric_writer``, the real client) write through two real web processes while
both are restarted mid-load — one killed (requests cut mid-transaction), one stopped — and
every point is then counted in the database: none lost, none stored twice, every value the
one sent. The clients retry each batch with its ``seq`` (their outbox) until a web answers.
``bench_ingest.py`` runs the same at 10M points (``ingest_concurrent_*``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.db.models import Count, Sum

from apps.core.actor import Actor
from apps.metrics.models import MetricBatch, MetricPoint, MetricRollup, MetricSeries
from apps.teams.services import worker_token_create
from tests.e2e.conftest import ROOT, purge_queues
from tests.e2e.faults import Processes, processes_fixture, tail  # noqa: F401 - the fixture
from tests.e2e.metric_writer import value_of
from tests.factories import ProjectFactory, TeamFactory, make_run

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(240)]

CLIENTS = 4
NAMES = [f"rank/m{k}" for k in range(8)]
STEPS = 3750  # per client: 4 x 8 x 3750 = 120,000 points
BATCH = 1000  # points a batch: 125 steps x 8 names, 30 batches per client


def _start_writers(processes: Processes, urls: list[str], token: str, run_ids: list[str],
                   folder: Path) -> list[subprocess.Popen]:
    env = processes.worker_env(token, CRUCIBLE_VAR_DIR=str(folder / "writers"))
    writers = []
    for i, run_id in enumerate(run_ids):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.metric_writer"], cwd=ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=(folder / f"writer-{i}.log").open("w"), text=True)
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"url": urls[i % len(urls)], "token": token,
                                     "run_id": run_id, "names": NAMES, "steps": STEPS,
                                     "batch_size": BATCH}) + "\n")
        proc.stdin.flush()
        writers.append(proc)
    return writers


def _protocol(proc: subprocess.Popen, folder: Path, i: int) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("BENCH "):
            return line[6:].strip()
    raise AssertionError(f"writer {i} ended early:\n{tail(folder / f'writer-{i}.log')}")


def test_no_point_lost_or_stored_twice_across_web_restarts(processes: Processes,
                                                           tmp_path: Path) -> None:
    purge_queues()
    team = TeamFactory(slug="ingest")
    project = ProjectFactory(team=team, slug="load")
    run_ids = [str(make_run(project).pk) for _ in range(CLIENTS)]
    _, token = worker_token_create(actor=Actor.system(), team=None, name="pool")
    web_a = processes
    # With a bounded database pool per web process, as bench_ingest runs them
    # (config/settings.py, DATABASE_POOL_SIZE; ignored on SQLite).
    web_a.start_web(DATABASE_POOL_SIZE="4")
    web_b = web_a.another_web()

    writers = _start_writers(processes, [web_a.url, web_b.url], token, run_ids, tmp_path)
    try:
        for i, proc in enumerate(writers):
            assert _protocol(proc, tmp_path, i) == "ready"
        for proc in writers:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        total = CLIENTS * STEPS * len(NAMES) // BATCH
        deadline = time.monotonic() + 120
        while MetricBatch.objects.filter(run_id__in=run_ids).count() < total // 4:
            assert time.monotonic() < deadline, "the writers stalled before the restart"
            time.sleep(0.2)
        # Mid-load: web A dies at once, web B shuts down cleanly; both come back on their
        # ports while the clients keep sending.
        assert web_a.web is not None
        web_a.web.kill()
        web_a.web.wait(timeout=30)
        web_b.stop_web()
        assert MetricBatch.objects.filter(run_id__in=run_ids).count() < total, \
            "the load was over before the restart: nothing was tested"
        web_a.start_web()
        web_b.start_web()
        results = [json.loads(_protocol(proc, tmp_path, i)) for i, proc in enumerate(writers)]
        for proc in writers:
            proc.wait(timeout=60)
    finally:
        for proc in writers:
            if proc.poll() is None:
                proc.kill()
    assert [r["points"] for r in results] == [STEPS * len(NAMES)] * CLIENTS
    assert sum(r["buffered"] for r in results) > 0, "no client ever found the webs down"

    points = MetricPoint.objects.filter(run_id__in=run_ids)
    expected = CLIENTS * STEPS * len(NAMES)
    assert points.count() == expected  # none lost ...
    assert not points.values("run_id", "name", "step").annotate(n=Count("id")) \
        .filter(n__gt=1).exists()  # ... none twice
    index = {name: k for k, name in enumerate(NAMES)}
    wrong = [(str(r), n, s, v) for r, n, s, v in points.values_list("run_id", "name", "step",
                                                                     "value")
             if not (0 <= s < STEPS and v == value_of(s, index[n]))]
    assert wrong == []
    # The bookkeeping agrees: each batch row names its own points, series and rollups count
    # every point once, and the stream positions of each run have no gap.
    for run_id in run_ids:
        batches = list(MetricBatch.objects.filter(run_id=run_id).order_by("stream_seq"))
        assert len(batches) == STEPS * len(NAMES) // BATCH
        assert sum(b.point_count for b in batches) == STEPS * len(NAMES)
        positions = [b.stream_seq for b in batches]
        assert positions == list(range(positions[0], positions[0] + len(positions)))
        assert {s.name: s.count for s in MetricSeries.objects.filter(run_id=run_id)} == \
            dict.fromkeys(NAMES, STEPS)
        widest = MetricRollup.objects.filter(run_id=run_id, width=262144)
        assert widest.aggregate(n=Sum("count"))["n"] == STEPS * len(NAMES)
