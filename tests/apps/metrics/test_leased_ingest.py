"""The one-statement ingest path (``metrics.services.store_leased_batch``, PostgreSQL): the
lease is checked and the run locked inside the ingest statement, outside any transaction.
Whatever the statement refuses goes through the locked path, so every answer is the one the
locked path gives; on SQLite these tests cover that path alone. Transactional tests: the
fast path only runs outside a transaction, which a plain ``django_db`` test wraps around."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.core.exceptions import LeaseError, NotFound
from apps.metrics.models import MetricBatch, MetricPoint
from apps.runs.models import Run
from apps.runs.services import ingest_metrics
from tests.factories import make_run

pytestmark = pytest.mark.django_db(transaction=True)

COLUMNS = {"name": ["loss", "kl", "loss"], "step": [1, 1, 2], "value": [0.5, 0.1, 0.4]}


@pytest.fixture
def leased_run(project) -> Run:
    run = make_run(project)
    Run.objects.filter(pk=run.pk).update(
        status="running", lease_id="lease-1", lease_holder="test",
        lease_expires_at=timezone.now() + timedelta(hours=1))
    return Run.objects.get(pk=run.pk)


def ingest(run: Run, seq: int = 1, lease: str = "lease-1", team_id: int | None = -1):
    return ingest_metrics(run=str(run.pk), lease_id=lease, seq=seq, columns=COLUMNS,
                          team_id=run.team_id if team_id == -1 else team_id)


def test_a_batch_is_one_statement_on_postgresql(leased_run):
    with CaptureQueriesContext(connection) as queries:
        assert ingest(leased_run) == (3, False)
    sql = [q["sql"] for q in queries.captured_queries]
    if connection.vendor == "postgresql":
        # No SELECT ... FOR UPDATE (the locked path's first query): the statement, on a raw
        # psycopg cursor Django does not log, was the whole transaction.
        assert not any("FOR UPDATE" in s for s in sql), sql
    assert MetricPoint.objects.filter(run=leased_run).count() == 3
    batch = MetricBatch.objects.get(run=leased_run, seq=1)
    leased_run.refresh_from_db()
    assert batch.stream_seq == leased_run.event_seq and batch.point_count == 3


def test_a_retried_seq_is_a_duplicate_and_stores_nothing(leased_run):
    assert ingest(leased_run) == (3, False)
    event_seq = Run.objects.get(pk=leased_run.pk).event_seq
    assert ingest(leased_run) == (0, True)
    assert MetricPoint.objects.filter(run=leased_run).count() == 3
    assert Run.objects.get(pk=leased_run.pk).event_seq == event_seq  # no position spent


@pytest.mark.parametrize(("change", "code"), [
    ({"lease_expires_at": timezone.now() - timedelta(seconds=1)}, "lease_expired"),
    ({"lease_expires_at": None}, "lease_expired"),
    ({"status": "canceled"}, "run_not_active"),
    ({"status": "succeeded"}, "run_not_active"),
    ({"lease_id": "lease-2"}, "lease_invalid"),
])
def test_a_lease_that_is_not_live_stores_nothing_and_says_why(leased_run, change, code):
    Run.objects.filter(pk=leased_run.pk).update(**change)
    event_seq = Run.objects.get(pk=leased_run.pk).event_seq
    with pytest.raises(LeaseError) as caught:
        ingest(leased_run)
    assert caught.value.code == code
    assert not MetricPoint.objects.filter(run=leased_run).exists()
    assert not MetricBatch.objects.filter(run=leased_run).exists()
    assert Run.objects.get(pk=leased_run.pk).event_seq == event_seq


def test_a_wrong_lease_id_is_refused_even_as_a_prefix(leased_run):
    for guess in ("", "lease-", "lease-1 ", "LEASE-1"):
        if not guess:
            with pytest.raises(LeaseError):
                ingest(leased_run, lease=guess)
            continue
        with pytest.raises(LeaseError) as caught:
            ingest(leased_run, lease=guess)
        assert caught.value.code == "lease_invalid"
    assert not MetricPoint.objects.filter(run=leased_run).exists()


def test_another_teams_run_is_404_and_an_operator_token_may_write(leased_run, other_team):
    with pytest.raises(NotFound):
        ingest(leased_run, team_id=other_team.pk)
    assert not MetricPoint.objects.filter(run=leased_run).exists()
    assert ingest(leased_run, team_id=None) == (3, False)  # operator token: any team


def test_a_malformed_run_id_is_404(leased_run):
    with pytest.raises(NotFound):
        ingest_metrics(run="not-a-uuid", lease_id="lease-1", seq=1, columns=COLUMNS,
                       team_id=leased_run.team_id)
