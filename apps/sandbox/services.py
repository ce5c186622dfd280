"""Writes for executions: submit (with the team's concurrency quota), start, finish."""

from __future__ import annotations

import hashlib
import secrets
import uuid
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from pydantic import ValidationError

from apps.core import audit, telemetry
from apps.core.actor import Actor
from apps.core.exceptions import Conflict, DomainError, InvalidInput, LeaseError, NotFound
from apps.sandbox.models import ACTIVE, Execution, ExecutionStatus
from apps.teams.models import Team
from config.celery import app
from workers.sandbox.spec import ExecutionRequest, Status

EXECUTE_TASK = "workers.tasks.execute_sandbox"
VERDICTS = frozenset(s.value for s in Status)


class QuotaExceeded(DomainError):
    status_code = 429
    code = "quota_exceeded"


def validate_request(data: Any, index: int | None = None) -> ExecutionRequest:
    try:
        return ExecutionRequest.model_validate(data)
    except ValidationError as exc:
        where = "" if index is None else f"requests[{index}]."
        details: dict[str, list[str]] = {}
        for err in exc.errors():
            path = where + ".".join(str(p) for p in err["loc"])
            details.setdefault(path or "request", []).append(
                "unknown field" if err["type"] == "extra_forbidden" else err["msg"])
        first = next(iter(details.items()))
        raise InvalidInput(f"{first[0]}: {first[1][0]}", details=details) from exc


def _enqueue(ids: list[str]) -> None:
    def send() -> None:
        for execution_id in ids:
            app.send_task(EXECUTE_TASK, args=[execution_id], queue="sandbox")

    transaction.on_commit(send)


def submit(*, actor: Actor, team: Team, requests: list[ExecutionRequest]) -> list[Execution]:
    """Queue executions if the team stays within its concurrency quota (else 429)."""
    quota = settings.CRUCIBLE["SANDBOX_QUOTA"]
    with transaction.atomic():
        Team.objects.select_for_update().get(pk=team.pk)  # serialises quota checks per team
        active = Execution.objects.filter(team=team, status__in=ACTIVE).count()
        if active + len(requests) > quota:
            raise QuotaExceeded(
                f"Team '{team.slug}' has {active} executions in flight and a quota of {quota}; "
                f"wait for some to finish or submit fewer than {quota - active + 1}.")
        batch = uuid.uuid4() if len(requests) > 1 else None
        rows = Execution.objects.bulk_create(
            Execution(team=team, created_by=actor.user, batch=batch, language=r.language,
                      request=r.model_dump(mode="json"))
            for r in requests
        )
        audit.record_many(actor=actor, rows=[
            {"action": "sandbox.execution.submit", "team_id": team.pk,
             "target_type": "execution", "target_id": row.pk,
             "data": {"language": row.language, "batch": str(batch) if batch else None,
                      "code_sha256": hashlib.sha256(
                          str(row.request.get("code", "")).encode()).hexdigest(),
                      "code_bytes": len(str(row.request.get("code", "")).encode())}}
            for row in rows])
        _enqueue([str(r.pk) for r in rows])
    return rows


def start(*, execution_id: object, worker: str, team_id: int | None, holder: str = "",
          actor: Actor | None = None) -> Execution:
    """Hand a queued execution to one worker under a lease (``lease_id``, held by the worker
    token ``holder``) that its result must come back under, before the lease expires."""
    with transaction.atomic():
        qs = Execution.objects.select_for_update().filter(pk=execution_id)
        if team_id is not None:
            qs = qs.filter(team_id=team_id)
        execution = qs.first()
        if execution is None:
            raise NotFound(f"No execution '{execution_id}'.")
        if execution.status != ExecutionStatus.QUEUED:
            raise Conflict(f"Execution {execution.pk} is {execution.status}; not starting it "
                           "again.", code="not_claimable")
        limits = execution.request.get("limits", {})
        budget = (limits.get("wall_ms", 10_000) * 3) / 1000 + 120  # compile + run + slack
        now = timezone.now()
        execution.status = ExecutionStatus.RUNNING
        execution.worker = worker[:200]
        execution.started_at = now
        execution.lease_expires_at = now + timedelta(seconds=budget)
        execution.lease_id = secrets.token_urlsafe(24)
        execution.lease_holder = holder[:16]
        execution.save(update_fields=["status", "worker", "started_at", "lease_expires_at",
                                      "lease_id", "lease_holder"])
        audit.record(actor=actor, action="sandbox.execution.start", team_id=execution.team_id,
                     target_type="execution", target_id=execution.pk,
                     data={"worker": execution.worker})
    return execution


def leased(execution: Execution, lease_id: str, holder: str) -> Execution:
    """The execution's row, locked for the caller's transaction, if it is running under the
    live lease ``lease_id`` (the start's answer; the worker sends it as ``X-Crucible-Lease``)
    held by the worker token ``holder``; LeaseError (409) otherwise, as for runs."""
    locked = Execution.objects.select_for_update().get(pk=execution.pk)
    if locked.status != ExecutionStatus.RUNNING:
        raise LeaseError(f"Execution {locked.pk} is {locked.status}, not running.",
                         code="not_running", details={"status": locked.status})
    if (not holder or not secrets.compare_digest(locked.lease_holder, holder)
            or not lease_id or not secrets.compare_digest(locked.lease_id, lease_id)):
        raise LeaseError(f"Execution {locked.pk} is leased to another worker; drop its result.")
    if locked.lease_expires_at is None or locked.lease_expires_at <= timezone.now():
        raise LeaseError(f"The lease on execution {locked.pk} expired; drop its result.",
                         code="lease_expired")
    return locked


def finish(*, execution: Execution, result: dict[str, Any] | None, error: str = "",
           lease_id: str, holder: str, actor: Actor | None = None) -> Execution:
    """The worker's result (or the engine's error), under the execution's lease."""
    with transaction.atomic():
        execution = leased(execution, lease_id, holder)
        execution.status = ExecutionStatus.ERROR if error else ExecutionStatus.DONE
        execution.result = result
        execution.error = error[:10_000]
        execution.finished_at = timezone.now()
        execution.save(update_fields=["status", "result", "error", "finished_at"])
        verdict = (result or {}).get("status") if isinstance(result, dict) else None
        audit.record(actor=actor, action="sandbox.execution.finish", team_id=execution.team_id,
                     target_type="execution", target_id=execution.pk,
                     data={"status": execution.status, "result": verdict,
                           "error": execution.error[:200]})
        telemetry.count_on_commit(telemetry.SANDBOX_FINISHED.labels(
            execution.status, _verdict_label(verdict) if not error else "none"))
    return execution


def _verdict_label(verdict: object) -> str:
    """The engine's verdict as a metric label: one of its Status values, else ``other`` (the
    result comes from a worker; a label must not take arbitrary values)."""
    return str(verdict) if verdict in VERDICTS else "other"


def sweep_lost() -> int:
    """Executions whose worker vanished: error, so they stop counting against the quota."""
    with transaction.atomic():
        lost = list(Execution.objects.select_for_update().filter(
            status=ExecutionStatus.RUNNING, lease_expires_at__lt=timezone.now()
        ).values_list("pk", "team_id"))
        if not lost:
            return 0
        Execution.objects.filter(pk__in=[pk for pk, _ in lost]).update(
            status=ExecutionStatus.ERROR, error="the sandbox worker was lost",
            finished_at=timezone.now())
        telemetry.count_on_commit(telemetry.SANDBOX_FINISHED.labels("lost", "none"), len(lost))
        audit.record_many(actor=Actor.system(), rows=[
            {"action": "sandbox.execution.lost", "team_id": team_id, "target_type": "execution",
             "target_id": pk} for pk, team_id in lost])
    return len(lost)
