"""The one lease check for worker output. Every service that accepts what a worker reports
about a run (status, heartbeats, events, metrics, checkpoints, samples, reports, QC reports,
review batches) takes the run through :func:`leased`: the row lock serialises it against
cancel, sweep and the other reports, and the check runs on the row as it is now, not as the
view read it."""

from __future__ import annotations

import re
import secrets
import uuid

from django.utils import timezone

from apps.core.exceptions import Conflict, LeaseError, NotFound
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


def leased_for_worker(team_id: int | None, run: str, lease_id: str) -> Run:
    """:func:`leased` for a run a worker token names in its URL, in one query where the
    view's ``run_for_worker`` then ``leased`` took two: a team token locks only its team's
    runs (an operator token, team_id None, any); a malformed id and a foreign run are the
    same 404, as in ``selectors.run_for_worker``. For the hottest worker call, a metric
    batch."""
    try:
        run_id = uuid.UUID(run)
    except ValueError as exc:
        raise NotFound(f"No run '{run}'.") from exc
    queryset = Run.objects.select_for_update().filter(pk=run_id)
    if team_id is not None:
        queryset = queryset.filter(team_id=team_id)
    locked = queryset.first()
    if locked is None:
        raise NotFound(f"No run '{run}'.")
    check_lease(locked, lease_id)
    return locked


# The folder an attempt's checkpoints go to (``workers.adapters.common.checkpoint_key``).
EPOCH_FOLDER = re.compile(r"/checkpoints/epoch-(\d+)/")


def check_epoch(run: Run, lease_epoch: int | None, uri: str) -> None:
    """Refuse (409 ``stale_epoch``) a checkpoint of another lease epoch than the run's current
    one, by the epoch the report carries or the ``epoch-<n>/`` folder its URI names: a live
    lease may not register what a revoked attempt wrote, so a resume never starts from it.
    (A revoked attempt's own reports already fail the lease check.)"""
    found = EPOCH_FOLDER.search(uri)
    claimed = {lease_epoch} if lease_epoch is not None else set()
    if found:
        claimed.add(int(found.group(1)))
    stale = sorted(e for e in claimed if e != run.lease_epoch)
    if stale:
        raise Conflict(f"This checkpoint belongs to lease epoch {stale[0]} of run {run.pk}; "
                       f"the run's current epoch is {run.lease_epoch}: a later claim replaced "
                       "that attempt, so its checkpoints are not recorded.", code="stale_epoch",
                       details={"lease_epoch": stale[0], "current": run.lease_epoch})
