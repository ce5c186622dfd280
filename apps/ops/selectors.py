"""What ``/metrics`` reads from the database at scrape time: a handful of aggregate queries
on indexed columns, the same answer from every web process (in-process gauges would each
know only their own process's requests)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db.models import Count, Min
from django.db.models.functions import Coalesce
from django.utils import timezone

from apps.runs.models import ACTIVE_STATUSES, Run, RunStatus
from apps.sandbox.models import ACTIVE as SANDBOX_ACTIVE
from apps.sandbox.models import Execution
from apps.scheduling.models import Node


@dataclass(frozen=True)
class QueueRow:
    pool: str
    team: str
    queued: int
    oldest_wait_s: float


@dataclass(frozen=True)
class NodeRow:
    name: str
    pool: str
    state: str
    heartbeat_age_s: float


def _age(since: datetime | None, now: datetime) -> float:
    return max(0.0, (now - since).total_seconds()) if since is not None else 0.0


def runs_by_state() -> dict[tuple[str, str], int]:
    """(status, pool) -> runs (the ``status, pool`` index)."""
    rows = Run.objects.order_by().values_list("status", "pool").annotate(n=Count("id"))
    return {(status, pool): n for status, pool, n in rows}


def queued_by_team(now: datetime | None = None) -> list[QueueRow]:
    """Queued runs per pool and team, with how long the oldest has waited (since it was
    last queued: a requeued run's wait restarts)."""
    now = now or timezone.now()
    rows = (Run.objects.filter(status=RunStatus.QUEUED).order_by()
            .values_list("pool", "team__slug")
            .annotate(n=Count("id"), oldest=Min(Coalesce("queued_at", "created_at"))))
    return [QueueRow(pool, team, n, _age(oldest, now)) for pool, team, n, oldest in rows]


def stalest_run_heartbeat(now: datetime | None = None) -> dict[str, float]:
    """Pool -> seconds since the stalest active run's worker last renewed its lease (a claim
    or heartbeat sets the expiry to now + the lease; past the lease the sweep requeues it)."""
    now = now or timezone.now()
    lease_s = float(settings.CRUCIBLE["LEASE_SECONDS"])
    rows = (Run.objects.filter(status__in=ACTIVE_STATUSES, lease_expires_at__isnull=False)
            .order_by().values_list("pool").annotate(first=Min("lease_expires_at")))
    return {pool: max(0.0, lease_s - (first - now).total_seconds()) for pool, first in rows}


def nodes(now: datetime | None = None) -> list[NodeRow]:
    now = now or timezone.now()
    return [NodeRow(name, pool, state, _age(beat, now)) for name, pool, state, beat in
            Node.objects.order_by("name").values_list("name", "pool", "state",
                                                      "last_heartbeat_at")]


def sandbox_active() -> dict[str, int]:
    """Executions queued or running (what counts against teams' quotas)."""
    rows = (Execution.objects.filter(status__in=SANDBOX_ACTIVE).order_by()
            .values_list("status").annotate(n=Count("id")))
    return dict(rows)
