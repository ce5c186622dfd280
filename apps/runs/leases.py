"""The one lease check for worker output. Every service that accepts what a worker reports
about a run (status, heartbeats, events, metrics, checkpoints, samples, reports, QC reports,
review batches) takes the run through :func:`leased`: the row lock serialises it against
cancel, sweep and the other reports, and the check runs on the row as it is now, not as the
view read it."""

from __future__ import annotations

import secrets

from django.utils import timezone

from apps.core.exceptions import LeaseError
from apps.runs.models import ACTIVE_STATUSES, Run


def check_lease(run: Run, lease_id: str) -> None:
    """Raise LeaseError unless ``lease_id`` is the run's live lease."""
    if run.status not in ACTIVE_STATUSES:
        raise LeaseError(f"Run {run.pk} is {run.status}; stop working on it.",
                         code="run_not_active", details={"status": run.status})
    if not lease_id or not secrets.compare_digest(run.lease_id, lease_id):
        raise LeaseError(f"Run {run.pk} is leased to another worker; stop working on it.")
    if run.lease_expires_at is None or run.lease_expires_at <= timezone.now():
        raise LeaseError(f"The lease on run {run.pk} expired; stop working on it.",
                         code="lease_expired")


def leased(run: Run, lease_id: str) -> Run:
    """The run's row, locked until the caller's transaction ends, if ``lease_id`` is its live
    lease; LeaseError (409) otherwise. Call it inside ``transaction.atomic()`` (Django
refuses a row lock outside one)."""
    locked = Run.objects.select_for_update().get(pk=run.pk)
    check_lease(locked, lease_id)
    return locked
