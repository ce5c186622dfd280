"""What a pass's actions mean for the database, as a plan (:func:`plan`, pure) and its
application (:func:`apply`, one transaction). Kept apart from the loop so the mapping from
``Admit``/``Wait``/``Preempt`` to rows is testable on its own."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.utils import timezone

from apps.core.actor import Actor
from apps.runs import dispatch, services
from apps.runs.models import ACTIVE_STATUSES, Run, RunStatus
from apps.scheduling import services as scheduling_services
from apps.scheduling.models import Allocation
from workers.scheduling.actions import Action, Admit, Preempt, Wait


@dataclass(frozen=True)
class WaitRow:
    reason: str
    position: int
    estimated_start_at: datetime | None


@dataclass
class Plan:
    """Rows one pass writes: new allocations, wait fields, victims to stop."""

    admits: list[Admit] = field(default_factory=list)
    waits: dict[str, WaitRow] = field(default_factory=dict)
    preempts: list[Preempt] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        return {"admitted": [a.workload_id for a in self.admits],
                "preempted": [p.workload_id for p in self.preempts],
                "waiting": len(self.waits)}


def plan(actions: Iterable[Action]) -> Plan:
    """Sort the engine's actions into rows to write (engine times are epoch seconds)."""
    out = Plan()
    for action in actions:
        if isinstance(action, Admit):
            out.admits.append(action)
        elif isinstance(action, Preempt):
            out.preempts.append(action)
        elif isinstance(action, Wait):
            start = None if action.estimated_start is None else \
                datetime.fromtimestamp(action.estimated_start, tz=UTC)
            out.waits[action.workload_id] = WaitRow(action.reason[:200], action.position, start)
    return out


def apply(result: Plan, runs: Mapping[str, Run], now: datetime) -> None:
    """Write the plan in the caller's transaction; dispatch what may start on commit."""
    actor = Actor.system()
    for admit in result.admits:
        run = runs[admit.workload_id]
        scheduling_services.allocate(run_id=run.pk, placement=dict(admit.allocation),
                                     flavor=admit.flavor, now=now)
        Run.objects.filter(pk=run.pk).update(wait_reason="", queue_position=None,
                                             estimated_start_at=None)
    for workload_id, wait in result.waits.items():
        before = runs.get(workload_id)
        if before is not None and (before.wait_reason, before.queue_position,
                                   before.estimated_start_at) == (
                wait.reason, wait.position, wait.estimated_start_at):
            continue  # a long backlog that did not move costs no writes
        Run.objects.filter(pk=workload_id, status=RunStatus.QUEUED).update(
            wait_reason=wait.reason, queue_position=wait.position,
            estimated_start_at=wait.estimated_start_at)
    grace = timedelta(seconds=settings.CRUCIBLE.get("PREEMPT_GRACE_S", 300))
    for preempt in result.preempts:
        services.request_preemption(actor=actor, run=runs[preempt.workload_id],
                                    deadline=now + grace,
                                    reason=f"{preempt.reason} (for run {preempt.for_workload})")
    dispatch_ready()


def dispatch_ready() -> list[str]:
    """Send every admitted run whose GPUs are physically free (no run that still holds them
    is claimed or running); a run admitted in place of preempted ones waits here until they
    have stopped. Marks the allocations dispatched so a run is sent once per admission."""
    pending = list(Allocation.objects.filter(
        released_at__isnull=True, dispatched_at__isnull=True,
        run__status=RunStatus.QUEUED).select_related("run", "node"))
    if not pending:
        return []
    busy: set[tuple[int, int]] = set()
    for a in Allocation.objects.filter(released_at__isnull=True,
                                       run__status__in=ACTIVE_STATUSES):
        busy.update((a.node_id, g) for g in a.gpu_ids)
    by_run: dict[object, list[Allocation]] = {}
    for a in pending:
        by_run.setdefault(a.run_id, []).append(a)
    sent = []
    for allocations in by_run.values():
        if any((a.node_id, g) in busy for a in allocations for g in a.gpu_ids):
            continue
        Allocation.objects.filter(pk__in=[a.pk for a in allocations]).update(
            dispatched_at=timezone.now())
        dispatch.send_on_commit(allocations[0].run, node=min(a.node.name for a in allocations))
        sent.append(str(allocations[0].run_id))
    return sent
