"""Writes for runs: launch, state transitions, leases, and what workers report.

Every status change goes through :func:`transition`, which locks the row, refuses an
illegal move with a 409, appends a status event and publishes it after commit.
"""

from __future__ import annotations

import logging
import secrets
import uuid
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.core import audit, events, limits, signals, telemetry
from apps.core.actor import Actor
from apps.core.exceptions import Conflict, IllegalTransition, InvalidInput
from apps.core.storage import store
from apps.environments import services as environment_services
from apps.environments.models import EnvironmentVersion
from apps.filtering import services as filtering
from apps.filtering.models import Surface
from apps.lineage import services as lineage
from apps.lineage.models import ArtifactType, LineageEdge
from apps.metrics import services as metric_services
from apps.metrics.sequence import allocate_stream_seq
from apps.metrics.writers import Lease
from apps.runs import dispatch, hooks, objects, scheduler, selectors
from apps.runs.leases import check_epoch, leased, leased_for_worker
from apps.runs.models import (
    ACTIVE_STATUSES,
    AttemptOutcome,
    Checkpoint,
    EventLevel,
    Run,
    RunAttempt,
    RunDataset,
    RunEnvironment,
    RunEvent,
    RunKind,
    RunStatus,
    RunTag,
    Sample,
)
from apps.runs.stream import event_message
from apps.runs.validation import RunPlan
from apps.scheduling import services as scheduling_services
from apps.scheduling.models import Allocation, Node
from workers.filtering import Mode
from workers.protocol import node_queue

log = logging.getLogger(__name__)
S = RunStatus
TRANSITIONS: dict[str, frozenset[str]] = {
    S.QUEUED: frozenset({S.CLAIMED, S.CANCELED}),
    S.CLAIMED: frozenset({S.RUNNING, S.FAILED, S.CANCELED, S.PREEMPTED, S.SUCCEEDED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.CANCELED, S.PREEMPTED}),
    S.PREEMPTED: frozenset({S.QUEUED, S.CANCELED, S.FAILED}),  # failed: out of attempts
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset({S.QUEUED}),  # resume
    S.CANCELED: frozenset({S.QUEUED}),  # resume
}
EVENT_LEVELS = set(EventLevel.values)
ATTEMPT_OUTCOMES = {S.SUCCEEDED: AttemptOutcome.SUCCEEDED, S.FAILED: AttemptOutcome.FAILED,
                    S.CANCELED: AttemptOutcome.CANCELED, S.PREEMPTED: AttemptOutcome.LOST}
MAX_MESSAGE = 10_000


def _lease_seconds() -> int:
    return settings.CRUCIBLE["LEASE_SECONDS"]


def _publish_run(run: Run, payload: dict[str, Any]) -> None:
    """To the run's stream (every message there carries its stream ``seq``)."""
    events.publish_on_commit(events.run_group(run.pk), payload)


def _publish_status(run: Run, previous: str | None) -> None:
    """To the team's runs table; the run's own stream gets the status event instead."""
    events.publish_on_commit(events.team_group(run.team_id), {
        "type": "run_status", "run": str(run.pk), "status": run.status, "from": previous,
        "updated_at": run.updated_at.isoformat(),
    })


def _append_events(run: Run, rows: list[dict[str, Any]]) -> list[RunEvent]:
    """Append events with gap-free sequence numbers; ``run`` must be locked by the caller."""
    first = allocate_stream_seq(run, len(rows))
    now = timezone.now()
    created = RunEvent.objects.bulk_create(
        RunEvent(run=run, seq=first + i, level=r.get("level", "info"), kind=r.get("kind", "log"),
                 message=r["message"], data=r.get("data") or {}, created_at=now)
        for i, r in enumerate(rows)
    )
    for event in created:
        _publish_run(run, event_message(event))
    _signal_events_on_commit(run, created)
    return created


def _signal_events_on_commit(run: Run, created: list[RunEvent]) -> None:
    """Tell the apps above (alerts) what the run's log says, once it is committed."""
    run_id, team_id = run.pk, run.team_id
    rows = [{"id": e.pk, "kind": e.kind, "level": e.level, "message": e.message,
             "data": e.data} for e in created]

    def send() -> None:
        for _, result in signals.run_events_appended.send_robust(
                sender=RunEvent, run_id=run_id, team_id=team_id, events=rows):
            if isinstance(result, Exception):
                log.error("run_events_appended receiver failed: %r", result)

    transaction.on_commit(send)


def _lock(run: Run) -> Run:
    return Run.objects.select_for_update().get(pk=run.pk)


def _pruned_message(ckpt: Checkpoint) -> str:
    return (f"Checkpoint at step {ckpt.step} of run {ckpt.run_id} was pruned by its run's "
            "checkpoint.keep (its object is deleted); start from a kept checkpoint "
            "(GET …/runs/<id>/checkpoints lists them, pruned ones with pruned_at).")


def create_run(*, actor: Actor, team_id: int, plan: RunPlan) -> Run:
    with transaction.atomic():
        now = timezone.now()
        run = Run.objects.create(
            team_id=team_id, project=plan.project, name=plan.name, kind=plan.kind,
            config=plan.config, pool=plan.pool, priority=plan.priority,
            environment_version=plan.environment, created_by=actor.user, queued_at=now,
            max_attempts=plan.max_attempts, base_checkpoint=plan.base_checkpoint,
            resources=plan.resources, priority_class=plan.priority_class,
        )
        RunTag.objects.freeze(run, plan.tags)
        for alias, version in plan.datasets.items():
            RunDataset.objects.create(run=run, dataset_version=version, alias=alias)
            lineage.edge_create(team_id=team_id, source=version, target=run, relation="input")
        environments = plan.environments or ([plan.environment] if plan.environment else [])
        for position, env_version in enumerate(environments):
            RunEnvironment.objects.create(run=run, environment_version=env_version,
                                          position=position)
            lineage.edge_create(team_id=team_id, source=env_version, target=run,
                                relation="environment")
        if plan.base_checkpoint is not None:
            base = Checkpoint.objects.select_for_update().get(pk=plan.base_checkpoint.pk)
            if base.pruned_at is not None:
                raise Conflict(_pruned_message(base))
            lineage.edge_create(team_id=team_id, source=base, target=run,
                                relation="base_model")
        _append_events(run, [{"kind": "status", "message": "queued",
                              "data": {"status": "queued", "document": plan.describe()}}])
        audit.record(actor=actor, action="run.create", team_id=team_id, target_type="run",
                     target_id=run.pk, data={"kind": run.kind, "pool": run.pool})
        _publish_status(run, None)
        dispatch.enqueue_on_commit(run)
    return run


def transition(
    *, actor: Actor, run: Run, to: str, error: str = "", reason: str = "", locked: bool = False,
    outcome: str | None = None,
) -> Run:
    """Move ``run`` to ``to`` or raise IllegalTransition (409). ``outcome`` overrides how the
    attempt that ends here is recorded (a scheduler preemption is not a lost worker)."""
    with transaction.atomic():
        run = run if locked else _lock(run)
        if to not in TRANSITIONS[run.status]:
            raise IllegalTransition(
                f"Run {run.pk} is {run.status}; it cannot become {to}.",
                details={"status": run.status, "requested": to},
            )
        now = timezone.now()
        previous = run.status
        run.status = to
        run.updated_at = now
        fields = ["status", "updated_at"]
        if to == S.CLAIMED:
            run.claimed_at = now
            run.attempt += 1
            fields += ["claimed_at", "attempt"]
        elif to == S.RUNNING:
            run.started_at = run.started_at or now
            fields.append("started_at")
        elif to == S.QUEUED:
            run.queued_at = now
            run.finished_at = None
            run.error = ""
            fields += ["queued_at", "finished_at", "error"]
        if to in (S.SUCCEEDED, S.FAILED, S.CANCELED):
            run.finished_at = now
            fields.append("finished_at")
        if to == S.FAILED:
            run.error = error[:MAX_MESSAGE] or "failed without an error message"
            fields.append("error")
        if to not in ACTIVE_STATUSES:
            run.lease_id = run.lease_holder = ""
            run.lease_expires_at = None
            run.preempt_deadline_at = None
            fields += ["lease_id", "lease_holder", "lease_expires_at", "preempt_deadline_at"]
        run.save(update_fields=fields)
        # Whatever way a run leaves claimed/running (or a queued run with an allocation is
        # canceled), its GPUs go back: the next pass may give them away.
        if to not in ACTIVE_STATUSES and to != previous and \
                scheduling_services.release_allocations(run_id=run.pk, now=now):
            dispatch.request_pass_on_commit()
        _record_attempt(run, previous, to, reason, outcome, now=now)
        message = to + (f": {reason}" if reason else "") + (f": {run.error}" if to == S.FAILED
                                                            else "")
        level = EventLevel.ERROR if to == S.FAILED else EventLevel.INFO
        _append_events(run, [{"kind": "status", "level": level, "message": message,
                              "data": {"status": to, "from": previous, "actor": actor.label}}])
        audit.record(actor=actor, action=f"run.{to}", team_id=run.team_id, target_type="run",
                     target_id=run.pk, data={"from": previous, "reason": reason})
        _publish_status(run, previous)
        if to == S.QUEUED:
            dispatch.enqueue_on_commit(run)
        if to == S.SUCCEEDED and run.kind == RunKind.TRAIN:
            transaction.on_commit(lambda: _observe_goodput(run.pk))
        if to in (S.SUCCEEDED, S.FAILED, S.CANCELED) and to != previous:
            run_id = run.pk
            transaction.on_commit(lambda: hooks.run_finished(run_id))
    return run


def _observe_goodput(run_id: uuid.UUID) -> None:
    """A succeeded train run's goodput into ``/metrics`` (two reads, once per run)."""
    run = Run.objects.filter(pk=run_id).first()
    value = selectors.run_goodput(run).goodput if run is not None else None
    if value is not None:
        telemetry.RUN_GOODPUT.observe(value)


def _record_attempt(run: Run, previous: str, to: str, reason: str,
                    outcome: str | None = None, *, now: datetime) -> None:
    """Open an attempt row on a claim; close it, with its outcome, when the run leaves the
    active statuses (the caller holds the run's lock). ``now`` is the transition's own time,
    so a run's claim and finish equal its attempts' (goodput adds them up exactly)."""
    if to == S.CLAIMED:
        RunAttempt.objects.create(run=run, number=run.attempt, worker=run.lease_holder,
                                  claimed_at=now)
    elif previous in ACTIVE_STATUSES and to not in ACTIVE_STATUSES:
        error = run.error if to == S.FAILED else (reason if to == S.PREEMPTED else "")
        RunAttempt.objects.filter(run=run, number=run.attempt,
                                  outcome=AttemptOutcome.ACTIVE).update(
            outcome=outcome or ATTEMPT_OUTCOMES[to], error=error[:MAX_MESSAGE], ended_at=now)


def attempts_left(run: Run) -> int:
    """Attempts this run may still make since it was launched or last resumed."""
    return max(0, run.max_attempts - (run.attempt - run.retry_base))


def cancel(*, actor: Actor, run: Run) -> Run:
    return transition(actor=actor, run=run, to=S.CANCELED, reason=f"by {actor.label}")


def resume(*, actor: Actor, run: Run) -> Run:
    """Queue a failed or canceled run again; its engine continues from its last checkpoint.
    A resumed run gets a fresh allowance of ``max_attempts``."""
    with transaction.atomic():
        run = transition(actor=actor, run=run, to=S.QUEUED, reason=f"resumed by {actor.label}")
        run.retry_base = run.attempt
        run.save(update_fields=["retry_base"])
    return run


# --- leases -------------------------------------------------------------------------------


def claim(
    *, actor: Actor, pool: str, worker_id: str, team_id: int | None, run_id: object = None,
    node: str | None = None,
) -> Run | None:
    """Give a worker the lease on a queued run (a specific one, or the next for ``pool``).

    Returns None when there is nothing to claim. Expired leases are swept first, so a run
    whose worker died is claimable again without waiting for the periodic sweep. With the
    scheduler on, ``node`` (the worker's node) must be one the run's allocation names.
    """
    sweep_expired(actor=Actor.system())
    with transaction.atomic():
        if run_id is not None:
            run = Run.objects.select_for_update().filter(pk=run_id).first()
            if run is None or (team_id is not None and run.team_id != team_id):
                return None
            if run.status != S.QUEUED:
                raise Conflict(f"Run {run.pk} is {run.status}, not queued; nothing to claim.",
                               code="not_claimable")
            if run.pool != pool:
                raise Conflict(f"Run {run.pk} belongs to pool '{run.pool}', not '{pool}'.",
                               code="wrong_pool")
            if scheduler.enabled():
                _check_admitted(run, node)
        else:
            candidates = Run.objects.select_for_update(skip_locked=_skip_locked()).filter(
                status=S.QUEUED, pool=pool
            )
            if scheduler.enabled():
                _require_node(node, what=f"a run of pool '{pool}'")
                candidates = candidates.filter(pk__in=Allocation.objects.filter(
                    released_at__isnull=True, dispatched_at__isnull=False,
                    node__name=node).values("run_id"))
            if team_id is not None:
                candidates = candidates.filter(team_id=team_id)
            run = candidates.order_by("-priority", "created_at").first()
            if run is None:
                return None
        run.lease_id = secrets.token_urlsafe(24)
        run.lease_epoch += 1
        run.lease_holder = worker_id[:200]
        run.lease_expires_at = timezone.now() + timedelta(seconds=_lease_seconds())
        run.save(update_fields=["lease_id", "lease_epoch", "lease_holder", "lease_expires_at"])
        return transition(actor=actor, run=run, to=S.CLAIMED, reason=f"by {run.lease_holder}",
                          locked=True)


def _require_node(node: str | None, *, what: str) -> None:
    if node is None:
        raise Conflict(f"With the scheduler on, a worker must say which node it runs on to "
                       f"claim {what} (the claim's 'node': CRUCIBLE_NODE_NAME, default the "
                       "host name); a run is claimable only on the nodes its allocation "
                       "names.", code="node_required")


def _check_admitted(run: Run, node: str | None) -> None:
    """With the scheduler on, a run is claimable only once a pass gave it an allocation and
    its GPUs are free (it was dispatched), and only from a node the allocation names (its
    GPU ids mean nothing elsewhere); 409 saying why not."""
    active = list(Allocation.objects.filter(run=run, released_at__isnull=True)
                  .select_related("node"))
    if not active:
        why = f" (waiting: {run.wait_reason})" if run.wait_reason else ""
        raise Conflict(f"Run {run.pk} has no allocation: the scheduler has not admitted it "
                       f"yet{why}; it is dispatched when it is.", code="not_admitted",
                       details={"wait_reason": run.wait_reason,
                                "queue_position": run.queue_position})
    if any(a.dispatched_at is None for a in active):
        raise Conflict(f"Run {run.pk} is admitted but waits for preempted runs to free its "
                       "GPUs; it is dispatched when they have stopped.", code="not_admitted")
    _require_node(node, what=f"run {run.pk}")
    names = sorted({a.node.name for a in active})
    if node not in names:
        raise Conflict(f"Run {run.pk} is allocated to node {', '.join(names)}, not to this "
                       f"worker's node '{node}': only a worker on {' or '.join(names)} may "
                       f"claim it (its message went to queue {node_queue(names[0])}).",
                       code="wrong_node", details={"nodes": names, "node": node})


def _skip_locked() -> bool:
    from django.db import connection

    return connection.features.has_select_for_update_skip_locked


def ingest_metrics(*, run: Run | str, lease_id: str, seq: Any, points: Any = None,
                   columns: Any = None, team_id: int | None = None) -> tuple[int, bool]:
    """A worker's metric batch (rows in ``points`` or parallel arrays in ``columns``), under
    the run's lease; returns (points stored, duplicate). The lock gives the run's batches
    consecutive stream positions. ``run`` as the id from a worker's URL (with the token's
    ``team_id``): on PostgreSQL first one autocommitted statement that locks the run, checks
    the lease and stores the batch (``store_leased_batch``); when that stores nothing (a
    stale lease, a foreign run, a retried seq) the run is found and locked in one query
    (``leased_for_worker``), which raises the right error, and the batch stored or found
    a duplicate under that lock."""
    batch = metric_services.validate_batch(seq, points, columns)
    if isinstance(run, str) and lease_id:
        try:
            run_id = uuid.UUID(run)
        except ValueError:
            run_id = None  # the locked path answers 404
        if run_id is not None:
            stored = metric_services.store_leased_batch(
                run_model=Run, run_id=run_id, seq=seq, columns=batch,
                lease=Lease(lease_id, tuple(map(str, ACTIVE_STATUSES)), timezone.now(), team_id))
            if stored is not None:
                return stored
    with transaction.atomic():
        locked = leased_for_worker(team_id, run, lease_id) if isinstance(run, str) \
            else leased(run, lease_id)
        return metric_services.store_batch(run=locked, seq=seq, columns=batch)


def report_qc(*, actor: Actor, run: Run, lease_id: str, report: dict[str, Any],
              uri: str) -> EnvironmentVersion:
    """A QC run's report, under its lease: it sets the pinned version's QC status."""
    with transaction.atomic():
        run = leased(run, lease_id)
        if run.kind != "qc" or run.environment_version_id is None:
            raise InvalidInput(f"Run {run.pk} is not a QC run of an environment version.",
                               details={"run": [run.kind]})
        objects.check_reported(run, uri)
        return environment_services.record_qc_report(
            actor=actor, version=run.environment_version, report=report, run_id=str(run.pk),
            report_uri=uri)


def heartbeat(*, run: Run, lease_id: str) -> Run:
    with transaction.atomic():
        run = leased(run, lease_id)
        run.lease_expires_at = timezone.now() + timedelta(seconds=_lease_seconds())
        run.save(update_fields=["lease_expires_at"])
    return run


def worker_transition(
    *, actor: Actor, run: Run, lease_id: str, to: str, error: str = "", retry: bool = False,
    cause: str | None = None, node: str | None = None,
    toolchains: dict[str, dict[str, Any]] | None = None, drained: bool = False,
) -> Run:
    """A worker's status report. ``preempted`` with ``drained``: the worker is shutting
    down and stopped the run itself (see :func:`finish_drain`). ``failed`` with ``retry``
    (an error another attempt may not meet: a lost node, an out-of-memory kill) queues the
    run again while it has attempts left; the failed attempt and its error stay in the run's
    attempts and events. ``cause="environment"`` (the sandbox its environments need failed
    its probe on ``node``) is retried likewise, counted against the node, and asks it to
    re-check."""
    if to not in (S.RUNNING, S.SUCCEEDED, S.FAILED, S.PREEMPTED):
        raise InvalidInput(f"Workers may set status running, succeeded, failed or (when the "
                           f"scheduler asked) preempted, not '{to}'.",
                           details={"status": [to]})
    with transaction.atomic():
        run = leased(run, lease_id)
        if to == S.PREEMPTED and drained:
            return finish_drain(actor=actor, run=run)
        if to == S.PREEMPTED:
            if run.preempt_deadline_at is None:
                raise InvalidInput(f"Run {run.pk} was not asked to stop for the scheduler; "
                                   "only a run whose heartbeat said 'stop: preempt' may report "
                                   "preempted.", details={"status": [to]})
            return finish_preemption(actor=actor, run=run, forced=False)
        environment = to == S.FAILED and cause == "environment"
        retry = retry or environment or (to == S.FAILED and cause == "infra")
        nodes = _allocated_nodes(run) if to in (S.SUCCEEDED, S.FAILED) else []
        if environment and not nodes:
            nodes = _registered(node)  # scheduler off: the node the worker says it ran on
        run = transition(actor=actor, run=run, to=to, error=error, locked=True)
        _record_on_nodes(nodes, to=to, infra=retry, detail=error)
        if environment:
            return _environment_failed(actor, run, nodes, node, toolchains or {})
        if to == S.FAILED and retry:
            _retry_or_give_up(actor, run, f"attempt {run.attempt} failed")
        return run


def _registered(node: str | None) -> list[str]:
    return [node] if node and Node.objects.filter(name=node).exists() else []


def _environment_failed(actor: Actor, run: Run, nodes: list[str], node: str | None,
                        toolchains: dict[str, dict[str, Any]]) -> Run:
    """The run's environment failed its sandbox probe (the run is failed and locked): ask
    its nodes to re-check, then retry it like an infrastructure failure; once out of
    attempts its error says the probe failed every time."""
    for name in nodes:
        scheduling_services.record_toolchain_failure(node=name, toolchains=toolchains,
                                                     run_id=str(run.pk))
    where = node or ", ".join(nodes) or "?"
    _retry_or_give_up(actor, run, f"attempt {run.attempt} failed (environment broken on node "
                                  f"{where})")
    if run.status == S.FAILED:
        used = run.attempt - run.retry_base
        run.error = (f"{run.error} — gave up after {used} of {run.max_attempts} attempts: "
                     "the environment's sandbox failed its health probe each time")[:MAX_MESSAGE]
        run.save(update_fields=["error"])
    return run


def _allocated_nodes(run: Run) -> list[str]:
    return sorted(set(Allocation.objects.filter(run=run, released_at__isnull=True)
                      .values_list("node__name", flat=True)))


def _record_on_nodes(nodes: list[str], *, to: str, infra: bool, detail: str) -> None:
    """The lemon rule's evidence: a failure marked retryable (a lost node, an OOM kill) is the
    node's fault; a success, or a failure of the run's own, clears the node's count."""
    for name in nodes:
        if to == S.SUCCEEDED:
            scheduling_services.record_run_success(node=name)
        else:
            scheduling_services.record_run_failure(node=name, infra=infra,
                                                   detail=detail[:200])


def _retry_or_give_up(actor: Actor, run: Run, why: str) -> None:
    """After a failed or lost attempt (status failed or preempted): queue the run again, or
    fail it for good once it has used ``max_attempts``."""
    used = run.attempt - run.retry_base
    if attempts_left(run) > 0:
        transition(actor=actor, run=run, to=S.QUEUED, locked=True,
                   reason=f"{why}; retrying (attempt {used + 1} of {run.max_attempts})")
    elif run.status == S.PREEMPTED:
        transition(actor=actor, run=run, to=S.FAILED, locked=True,
                   error=f"{why}; gave up after {used} of {run.max_attempts} attempts")
    else:
        _append_events(run, [{"kind": "log", "level": EventLevel.ERROR,
                              "message": f"gave up after {used} of {run.max_attempts} attempts",
                              "data": {"attempts": used}}])


def sweep_expired(*, actor: Actor) -> list[Run]:
    """Runs whose lease ran out: preempted, then queued again (two recorded transitions),
    or failed once the run has used its ``max_attempts``."""
    swept = []
    expired = Run.objects.filter(status__in=ACTIVE_STATUSES, lease_expires_at__lt=timezone.now())
    for run_id in list(expired.values_list("pk", flat=True)[:100]):
        with transaction.atomic():
            run = Run.objects.select_for_update().get(pk=run_id)
            if run.status not in ACTIVE_STATUSES or run.lease_expires_at >= timezone.now():
                continue
            holder = run.lease_holder
            _lose(actor, run, f"lease held by {holder or 'a worker'} expired")
            swept.append(run)
    return swept


def _lose(actor: Actor, run: Run, reason: str) -> None:
    """The locked, active ``run`` lost its worker: the attempt ends ``lost`` (preempted, then
    queued again or failed once out of attempts), counted against its nodes."""
    holder = run.lease_holder
    nodes = _allocated_nodes(run)
    transition(actor=actor, run=run, to=S.PREEMPTED, locked=True, reason=reason)
    _record_on_nodes(nodes, to=S.FAILED, infra=True, detail=f"worker {holder or '?'} lost")
    _retry_or_give_up(actor, run, f"worker {holder or '?'} lost on attempt {run.attempt}")


def release_dead_leases(*, actor: Actor, node: str,
                        leases: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """A node agent found these leases' worker processes dead on ``node``: each run still held
    under that very lease is requeued now instead of when the lease expires (why: a SIGKILLed
    worker sends nothing, and its run used to wait out the whole lease). A lease that already
    moved on (the run finished, was swept, or was claimed again) is left alone. Returns the
    run ids released and those left alone."""
    released, ignored = [], []
    for lease in leases:
        with transaction.atomic():
            run = Run.objects.select_for_update().filter(pk=lease["run"]).first()
            if run is None or run.status not in ACTIVE_STATUSES or not run.lease_id or \
                    not secrets.compare_digest(run.lease_id, lease["lease_id"]):
                ignored.append(str(lease["run"]))
                continue
            who = lease.get("worker") or run.lease_holder or "a worker"
            _lose(actor, run, f"worker {who} died (its process is gone, reported by the "
                              f"agent of node {node})")
            released.append(str(run.pk))
    return released, ignored


def request_preemption(*, actor: Actor, run: Run, deadline: Any, reason: str) -> Run:
    """The scheduler needs this run's GPUs: ask its worker to checkpoint and stop (the
    heartbeat answer says ``stop: preempt``); at ``deadline`` the lease is revoked."""
    with transaction.atomic():
        run = _lock(run)
        if run.status not in ACTIVE_STATUSES or run.preempt_deadline_at is not None:
            return run
        run.preempt_deadline_at = deadline
        run.save(update_fields=["preempt_deadline_at"])
        _append_events(run, [{"kind": "scheduler", "level": EventLevel.WARNING,
                              "message": f"preemption requested: {reason}; checkpoint and "
                                         f"stop by {deadline:%H:%M:%S} UTC",
                              "data": {"deadline": deadline.isoformat(), "reason": reason}}])
        audit.record(actor=actor, action="run.preempt_request", team_id=run.team_id,
                     target_type="run", target_id=run.pk, data={"reason": reason})
    return run


def finish_preemption(*, actor: Actor, run: Run, forced: bool) -> Run:
    """Stop a run the scheduler preempted and put it back in the queue: not a failure (the
    attempt does not count against ``max_attempts``), ``preemptions`` + 1, and its engine
    resumes from its last checkpoint as after a lost lease."""
    with transaction.atomic():
        run = _lock(run)
        if run.status not in ACTIVE_STATUSES:
            return run
        how = "lease revoked at the deadline" if forced else "stopped"
        transition(actor=actor, run=run, to=S.PREEMPTED, locked=True,
                   reason=f"preempted by the scheduler ({how})",
                   outcome=AttemptOutcome.PREEMPTED)
        run.preemptions += 1
        run.retry_base += 1  # the attempt is given back
        run.save(update_fields=["preemptions", "retry_base"])
        transition(actor=actor, run=run, to=S.QUEUED, locked=True,
                   reason=f"requeued after preemption {run.preemptions}")
    return run


def finish_drain(*, actor: Actor, run: Run) -> Run:
    """The run's worker is shutting down (SIGTERM: a deploy, a scale-down, a node drain) and
    stopped the run after checkpointing what it could: the attempt ends ``drained`` and is
    given back (not the run's failure, nor a scheduler preemption), and the run is queued
    again at once instead of waiting out its lease."""
    with transaction.atomic():
        run = _lock(run)
        if run.status not in ACTIVE_STATUSES:
            return run
        holder = run.lease_holder or "its worker"
        transition(actor=actor, run=run, to=S.PREEMPTED, locked=True,
                   reason=f"drained: {holder} is shutting down",
                   outcome=AttemptOutcome.DRAINED)
        run.retry_base += 1  # the attempt is given back
        run.save(update_fields=["retry_base"])
        transition(actor=actor, run=run, to=S.QUEUED, locked=True,
                   reason="requeued after its worker drained")
    return run


def attempt_started(*, run: Run, lease_id: str, resume_step: int) -> RunAttempt:
    """The worker's startup for the current attempt is over and its work begins (from
    checkpoint ``resume_step``): stamped once, with the web's clock like the claim."""
    with transaction.atomic():
        run = leased(run, lease_id)
        attempt = RunAttempt.objects.select_for_update().get(run=run, number=run.attempt)
        if attempt.started_at is None:
            attempt.started_at = timezone.now()
            attempt.resume_step = resume_step
            attempt.save(update_fields=["started_at", "resume_step"])
    return attempt


def enforce_preemption_deadlines(*, actor: Actor, now: Any = None) -> list[Run]:
    """Revoke the leases of preempted runs that did not stop by their deadline."""
    now = now or timezone.now()
    late = Run.objects.filter(status__in=ACTIVE_STATUSES, preempt_deadline_at__lte=now)
    return [finish_preemption(actor=actor, run=run, forced=True) for run in late[:100]]


# --- what workers report -------------------------------------------------------------------


def append_events(*, run: Run, lease_id: str, rows: list[dict[str, Any]]) -> list[RunEvent]:
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("message"), str):
            raise InvalidInput(f"events[{i}] needs a string 'message'.")
        if row.get("level", "info") not in EVENT_LEVELS:
            raise InvalidInput(f"events[{i}].level must be one of {sorted(EVENT_LEVELS)}.")
        if not isinstance(row.get("data", {}), dict):
            raise InvalidInput(f"events[{i}].data must be an object.")
        limits.check_json(row.get("data") or {}, field=f"events[{i}].data",
                          limit=limits.SMALL_JSON_BYTES)
        row["message"] = row["message"][:MAX_MESSAGE]
        row["kind"] = str(row.get("kind", "log"))[:32]
    with transaction.atomic():
        run = leased(run, lease_id)
        return _append_events(run, rows)


def add_checkpoint(
    *, actor: Actor, run: Run, lease_id: str, step: int, uri: str, metrics: dict[str, Any],
    resumable: bool = False, keep: int | None = None, lease_epoch: int | None = None,
) -> tuple[Checkpoint, bool]:
    """Record a checkpoint the worker uploaded under the run's prefix (once per step; the
    same step again with the same URI is a retry and records nothing new); with ``keep``,
    then prune the run's resumable checkpoints in the object store down to the newest
    ``keep`` (see ``prune_checkpoints``; a retry prunes again, which changes nothing). Only
    the current lease epoch's checkpoints are recorded (``check_epoch``): what a resume
    reads is what a live lease wrote."""
    with transaction.atomic():
        run = leased(run, lease_id)
        check_epoch(run, lease_epoch, uri)
        existing = Checkpoint.objects.filter(run=run, step=step).first()
        if existing is not None:
            if existing.uri != uri:
                raise Conflict(f"Checkpoint at step {step} already exists with another URI.")
            ckpt, created = existing, False
        else:
            objects.check_reported(run, uri)
            ckpt = Checkpoint.objects.create(run=run, team_id=run.team_id, step=step, uri=uri,
                                             metrics=metrics, resumable=resumable)
            lineage.edge_create(team_id=run.team_id, source=run, target=ckpt,
                                relation="produced")
            _append_events(run, [{"kind": "checkpoint", "message": f"checkpoint at step {step}",
                                  "data": {"step": step, "uri": uri}}])
            audit.record(actor=actor, action="run.checkpoint", team_id=run.team_id,
                         target_type="checkpoint", target_id=ckpt.pk,
                         data={"run": str(run.pk), "step": step, "uri": uri})
            created = True
            ckpt_id = ckpt.pk
            transaction.on_commit(lambda: hooks.checkpoint_added(ckpt_id))
        if keep is not None:
            prune_checkpoints(run=run, keep=keep, locked=True)
    return ckpt, created


def prune_checkpoints(*, run: Run, keep: int, locked: bool = False) -> list[Checkpoint]:
    """Apply ``checkpoint.keep`` in the object store: of the run's resumable checkpoints,
    the newest ``keep`` stay, and so does every one that lineage points to (a run that
    started from it: an eval's or a fine-tune's base model); the others' objects are deleted
    once the transaction commits, their rows kept with ``pruned_at`` (the run's history and
    metrics stay). The final model export is not resumable and never pruned here.

    The checkpoint rows are locked, and ``create_run`` locks the base checkpoint it pins
    and refuses a pruned one, so a launch racing a prune either lands before it (and
    protects the checkpoint) or is refused: no run is ever left pointing at a deleted
    object."""
    if keep < 1:
        raise InvalidInput("checkpoint keep must be at least 1.", details={"keep": [keep]})
    with transaction.atomic():
        run = run if locked else _lock(run)
        live = list(Checkpoint.objects.select_for_update().filter(
            run=run, resumable=True, pruned_at__isnull=True).order_by("-step"))
        candidates = live[keep:]
        if not candidates:
            return []
        ids = [str(c.pk) for c in candidates]
        referenced = set(LineageEdge.objects.filter(
            team_id=run.team_id, source_type=ArtifactType.CHECKPOINT, source_id__in=ids,
        ).values_list("source_id", flat=True))
        referenced |= {str(pk) for pk in Run.objects.filter(
            base_checkpoint__in=[c.pk for c in candidates]).values_list(
                "base_checkpoint_id", flat=True)}
        pruned = [c for c in candidates if str(c.pk) not in referenced]
        if not pruned:
            return []
        now = timezone.now()
        Checkpoint.objects.filter(pk__in=[c.pk for c in pruned]).update(pruned_at=now)
        kept = [c.step for c in candidates if str(c.pk) in referenced]
        _append_events(run, [{
            "kind": "checkpoint", "level": "info",
            "message": f"checkpoint at step {c.step} pruned (checkpoint.keep = {keep})",
            "data": {"step": c.step, "uri": c.uri, "keep": keep, "kept_for_lineage": kept},
        } for c in pruned])
        audit.record(actor=Actor.system(), action="run.checkpoints.prune",
                     team_id=run.team_id, target_type="run", target_id=run.pk,
                     data={"steps": [c.step for c in pruned], "keep": keep})
        # Only objects under the run's own prefixes are deleted: a row from before URIs were
        # confined may point anywhere, and pruning must never reach another run's objects.
        own = [c.uri for c in pruned if objects.owns(run, c.uri)]
        for c in pruned:
            if c.uri not in own:
                log.warning("pruned checkpoint %s is not under run %s's objects; its object is "
                            "left alone", c.uri, run.pk)
        transaction.on_commit(lambda: _delete_objects(own))
    return pruned


def _delete_objects(uris: list[str]) -> None:
    """Delete pruned checkpoint objects (already confined to their run's prefixes). A
    failure leaves an orphan object (space, not data: its row already says pruned), logged
    for the operator."""
    for uri in uris:
        try:
            store().delete(uri)
        except Exception:  # noqa: BLE001 - one failed delete must not stop the others
            log.warning("could not delete pruned checkpoint object %s", uri, exc_info=True)


def add_samples(*, actor: Actor, run: Run, lease_id: str, rows: list[dict[str, Any]],
                flags: dict[int, list[str]] | None = None, filter_mode: str = "off") -> int:
    """Store a batch. ``flags``: the output filter's kinds per row index (rows already
    redacted under ``redact``), logged as findings on the stored samples."""
    with transaction.atomic():
        run = leased(run, lease_id)
        created = Sample.objects.bulk_create(
            Sample(run=run, team_id=run.team_id, step=r["step"], prompt=r["prompt"],
                   completion=r["completion"], reward=r.get("reward"),
                   reward_components=r.get("reward_components") or {},
                   advantage=r.get("advantage"), weight_version=r.get("weight_version"),
                   finish_reason=r.get("finish_reason") or "")
            for r in rows
        )
        if flags:
            filtering.log_many(team_id=run.team_id, surface=Surface.SAMPLES,
                               action=Mode(filter_mode), target_type="sample",
                               hits={created[i].pk: kinds for i, kinds in flags.items()})
        steps = [r["step"] for r in rows]
        audit.record(actor=actor, action="run.samples", team_id=run.team_id, target_type="run",
                     target_id=run.pk, data={"count": len(rows), "first_step": min(steps),
                                             "last_step": max(steps)})
    return len(rows)


def set_report(*, actor: Actor, run: Run, lease_id: str, uri: str) -> Run:
    """Point the run at the report its worker uploaded under the run's prefix."""
    with transaction.atomic():
        run = leased(run, lease_id)
        objects.check_reported(run, uri)
        previous = run.report_uri
        run.report_uri = uri
        run.save(update_fields=["report_uri"])
        lineage.edge_create(team_id=run.team_id, source=run,
                            target=(ArtifactType.REPORT, str(run.pk)), relation="reported")
        _append_events(run, [{"kind": "artifact", "message": "report stored",
                              "data": {"uri": uri}}])
        audit.record(actor=actor, action="run.report", team_id=run.team_id, target_type="run",
                     target_id=run.pk, data={"uri": uri, "previous": previous})
    return run
