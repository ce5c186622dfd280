"""Concurrent writers of one run on PostgreSQL: retries of the same ``seq`` racing each other
store each batch once, and the stored batches take consecutive stream positions (a replaying
client can tell a gap from the end)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, connections
from django.utils import timezone

from apps.metrics.models import MetricBatch, MetricPoint, MetricRollup, MetricSeries
from apps.runs.models import Run
from apps.runs.services import ingest_metrics
from tests.factories import make_run

WRITERS = 6
BATCHES = 8


@pytest.fixture
def leased_run(project) -> Run:
    run = make_run(project)
    Run.objects.filter(pk=run.pk).update(
        status="running", lease_id="lease-1", lease_holder="test",
        lease_expires_at=timezone.now() + timedelta(hours=1))
    return Run.objects.get(pk=run.pk)


def _batch(seq: int) -> list[dict]:
    return [{"name": f"m{k}", "step": seq * 10 + i, "value": float(seq * 100 + i * 8 + k)}
            for i in range(10) for k in range(8)]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("by_id", [False, True], ids=["locked-path", "one-statement-path"])
def test_racing_retries_store_each_batch_once_with_contiguous_stream(leased_run, by_id):
    """by_id: the run as a worker's URL names it, which takes the one-statement path (lease
    checked and row locked in the ingest statement, no transaction around it); a Run object
    takes the locked path."""
    if connection.vendor != "postgresql":
        pytest.skip("host: row-lock races need PostgreSQL (the PG configuration runs this)")
    results: list[tuple[int, int, bool]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(WRITERS)

    def writer() -> None:
        try:
            start.wait()
            for seq in range(BATCHES):  # every writer sends every batch: 5 of 6 are retries
                stored, duplicate = ingest_metrics(
                    run=str(leased_run.pk) if by_id else leased_run, lease_id="lease-1",
                    seq=seq, points=_batch(seq), team_id=leased_run.team_id)
                results.append((seq, stored, duplicate))
        except BaseException as exc:  # noqa: BLE001 - reported below, not swallowed
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=writer) for _ in range(WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    stored = [(seq, n) for seq, n, duplicate in results if not duplicate]
    assert sorted(stored) == [(seq, 80) for seq in range(BATCHES)]
    assert sum(1 for *_, duplicate in results if duplicate) == BATCHES * (WRITERS - 1)
    assert MetricPoint.objects.filter(run=leased_run).count() == BATCHES * 80
    batches = list(MetricBatch.objects.filter(run=leased_run).order_by("stream_seq"))
    positions = [b.stream_seq for b in batches]
    assert positions == list(range(positions[0], positions[0] + BATCHES))
    for b in batches:  # each batch row names exactly its own points
        ids = MetricPoint.objects.filter(run=leased_run, id__gte=b.first_id, id__lte=b.last_id)
        assert ids.count() == b.point_count == 80
        assert {p.step // 10 for p in ids} == {b.seq}
    assert {s.name: s.count for s in MetricSeries.objects.filter(run=leased_run)} == \
        {f"m{k}": BATCHES * 10 for k in range(8)}
    widest = MetricRollup.objects.filter(run=leased_run, width=262144)
    assert sum(r.count for r in widest) == BATCHES * 80
