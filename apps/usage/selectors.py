"""Reads for the usage page and API: a team's runs, their attempts, allocations, resumable
checkpoints and idle fractions loaded in a handful of queries, turned into GPU/CPU-seconds
per part (:mod:`apps.usage.accounting`) for a time window, per day and per run, and priced
with the configured hourly rates."""

from __future__ import annotations

import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Avg, Exists, Max, OuterRef, Q, QuerySet
from django.utils import timezone
from pydantic import ValidationError

from apps.core.exceptions import InvalidInput, NotFound
from apps.metrics.models import MetricBatch, MetricPoint
from apps.runs.goodput import Attempt, CheckpointMark
from apps.runs.models import FINAL_STATUSES, Checkpoint, Run, RunAttempt
from apps.scheduling.models import Allocation
from apps.teams.models import Team
from apps.usage import accounting
from apps.usage.accounting import IDLE_PARTS, PARTS, Hold, Usage
from workers.scheduling.spec import CPU_FLAVOR, Resources

#: The trainer's per-step idle fractions (workers/rl/trainer.py ``rl_step``).
IDLE_METRICS = {"async/learner_idle": "idle_learner", "async/generator_idle": "idle_generators"}
MAX_DAYS = 366
DEFAULT_DAYS = 7
GROUPS = ("day",)
#: Flavor of GPU work whose type is unknown (scheduler off, the request names no one type).
ANY_GPU = "gpu"


@dataclass
class RunUsage:
    run: Run
    usage: Usage
    redone_steps: int = 0  # over the run's whole life, not only the window


@dataclass
class TeamUsage:
    start: datetime
    end: datetime
    total: Usage
    days: list[tuple[date, Usage]]
    runs: list[RunUsage]


def rates() -> dict[str, float]:
    return dict(settings.CRUCIBLE["COST_PER_GPU_HOUR"])


def currency() -> str:
    return str(settings.CRUCIBLE["COST_CURRENCY"])


def _parse_bound(raw: str, name: str, *, end: bool) -> datetime:
    """A date (``2026-01-31``: its midnight, UTC; as ``to``, the end of that day) or an ISO
    8601 time (UTC when it names no offset)."""
    text = raw.strip()
    try:
        day = date.fromisoformat(text)
    except ValueError:
        pass
    else:
        at = datetime.combine(day, time(), tzinfo=UTC)
        return at + timedelta(days=1) if end else at
    try:
        at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise InvalidInput(f"'{name}' must be a date (2026-01-31) or an ISO 8601 time "
                           f"(2026-01-31T12:00:00Z), not '{raw}'.", code="invalid_window") from exc
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def window(params: Any, now: datetime | None = None) -> tuple[datetime, datetime, str]:
    """``from``, ``to`` and ``group`` from a query string: by default the last 7 days up to
    now; at most 366 days; ``group`` is ``day``."""
    now = now or timezone.now()
    raw_to, raw_from = params.get("to") or "", params.get("from") or ""
    end = _parse_bound(raw_to, "to", end=True) if raw_to else now
    start = (_parse_bound(raw_from, "from", end=False) if raw_from else
             datetime.combine((end - timedelta(seconds=1)).date(), time(), tzinfo=UTC)
             - timedelta(days=DEFAULT_DAYS - 1))
    if start >= end:
        raise InvalidInput(f"'from' ({start.isoformat()}) must be before 'to' "
                           f"({end.isoformat()}).", code="invalid_window")
    if end - start > timedelta(days=MAX_DAYS):
        raise InvalidInput(f"The window is {(end - start).days} days; at most {MAX_DAYS} "
                           "days at a time.", code="invalid_window")
    group = params.get("group") or "day"
    if group not in GROUPS:
        raise InvalidInput(f"'group' must be one of {', '.join(GROUPS)}, not '{group}'.",
                           code="invalid_group")
    return start, end, group


def _resources(run: Run) -> Resources:
    try:
        return Resources.model_validate(run.resources or {})
    except ValidationError:  # frozen before a schema change: count it as the defaults
        return Resources()


def _holds(run: Run, attempts: list[Attempt], allocations: list[Allocation]) -> list[Hold]:
    """The run's allocations (each one node's GPU ids and cores); with none (the scheduler
    off), each attempt held what the run asked for."""
    req = _resources(run)
    if allocations:
        return [Hold(a.created_at.timestamp(), _seconds(a.released_at), len(a.gpu_ids),
                     req.cpus, a.flavor if a.gpu_ids else CPU_FLAVOR) for a in allocations]
    gpus = req.total_gpus
    flavor = (req.gpu_types[0] if len(req.gpu_types) == 1 else ANY_GPU) if gpus else CPU_FLAVOR
    return accounting.attempt_holds(attempts, gpus=gpus, cpus=req.cpus * req.nodes,
                                    flavor=flavor)


def _seconds(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def _runs(team: Team, start: datetime, end: datetime) -> QuerySet[Run]:
    """The team's runs that may have held something inside the window: created before its
    end, not finished before its start, and claimed or admitted at least once."""
    held = Exists(RunAttempt.objects.filter(run=OuterRef("pk"))) | Exists(
        Allocation.objects.filter(run=OuterRef("pk")))
    return (Run.objects.filter(team=team, created_at__lt=end)
            .filter(Q(finished_at__isnull=True) | Q(finished_at__gte=start))
            .filter(held).select_related("project").order_by("-created_at", "-id"))


def _reached(run_id: uuid.UUID, attempt: Attempt) -> int | None:
    """The last step an ended attempt reported: the highest step of the last metric batch
    the web received during it (replayed steps are dropped at ingest, so a batch holds only
    new steps). None when it reported none."""
    assert attempt.ended_at is not None
    batch = (MetricBatch.objects.filter(
        run_id=run_id, point_count__gt=0,
        received_at__gte=datetime.fromtimestamp(attempt.claimed_at, UTC),
        received_at__lte=datetime.fromtimestamp(attempt.ended_at, UTC))
        .order_by("-received_at", "-id").values_list("first_id", "last_id").first())
    if batch is None:
        return None
    found: int | None = MetricPoint.objects.filter(
        run_id=run_id, id__gte=batch[0], id__lte=batch[1]).aggregate(m=Max("step"))["m"]
    return found


def _load(runs: list[Run], now: datetime,
          ) -> tuple[dict[uuid.UUID, list[accounting.Piece]], dict[uuid.UUID, int]]:
    """Each run's pieces and its steps trained twice."""
    ids = [r.pk for r in runs]
    attempts: dict[uuid.UUID, list[Attempt]] = defaultdict(list)
    for a in RunAttempt.objects.filter(run_id__in=ids).order_by("number"):
        attempts[a.run_id].append(Attempt(
            number=a.number, outcome=a.outcome, claimed_at=a.claimed_at.timestamp(),
            ended_at=_seconds(a.ended_at), started_at=_seconds(a.started_at),
            resume_step=a.resume_step))
    marks: dict[uuid.UUID, list[CheckpointMark]] = defaultdict(list)
    for run_id, step, created in Checkpoint.objects.filter(
            run_id__in=ids, resumable=True).values_list("run_id", "step", "created_at"):
        marks[run_id].append(CheckpointMark(step=step, created_at=created.timestamp()))
    allocations: dict[uuid.UUID, list[Allocation]] = defaultdict(list)
    for alloc in Allocation.objects.filter(run_id__in=ids).order_by("id"):
        allocations[alloc.run_id].append(alloc)
    out, redone = {}, {}
    for run in runs:
        finished = run.finished_at if run.status in FINAL_STATUSES else None
        out[run.pk] = accounting.pieces(
            attempts[run.pk], marks[run.pk], _holds(run, attempts[run.pk], allocations[run.pk]),
            now=now.timestamp(), finished_at=_seconds(finished))
        redone[run.pk] = accounting.redone_steps(attempts[run.pk], {
            a.number: _reached(run.pk, a) for a in accounting.needs_reached(attempts[run.pk])})
    return out, redone


def _idle(ids: list[uuid.UUID]) -> dict[uuid.UUID, dict[str, float]]:
    """Each run's step-averaged idle fractions, where its trainer reported them."""
    out: dict[uuid.UUID, dict[str, float]] = defaultdict(dict)
    for row in (MetricPoint.objects.filter(run_id__in=ids, name__in=list(IDLE_METRICS))
                .values("run_id", "name").annotate(mean=Avg("value")).order_by()):
        out[row["run_id"]][IDLE_METRICS[row["name"]]] = row["mean"]
    return out


def _with_idle(usage: Usage, fractions: dict[str, float]) -> Usage:
    return usage.with_idle(fractions.get("idle_learner"), fractions.get("idle_generators"))


def team_usage(team: Team, start: datetime, end: datetime,
               now: datetime | None = None) -> TeamUsage:
    """What the team's runs held inside [start, end): in total, per UTC day and per run
    (runs that held nothing inside the window left out; newest first)."""
    now = now or timezone.now()
    runs = list(_runs(team, start, end))
    pieces, redone = _load(runs, now)
    idle = _idle([r.pk for r in runs])
    lo, hi = start.timestamp(), end.timestamp()  # pieces end at ``now`` at the latest
    total = Usage()
    days = {d: Usage() for d, _ in accounting.day_bounds(lo, hi)}
    rows = []
    for run in runs:
        usage = _with_idle(accounting.tally(pieces[run.pk], lo, hi), idle[run.pk])
        if usage.allocated_gpu_s <= 0 and usage.allocated_cpu_s <= 0:
            continue
        rows.append(RunUsage(run, usage, redone[run.pk]))
        total.add(usage)
        for d, u in accounting.tally_by_day(pieces[run.pk], lo, hi).items():
            days[d].add(_with_idle(u, idle[run.pk]))
    return TeamUsage(start=start, end=end, total=total, runs=rows, days=[
        (datetime.fromtimestamp(d, UTC).date(), u) for d, u in sorted(days.items())])


def run_usage(team: Team, run_id: str, now: datetime | None = None) -> RunUsage:
    """One run's usage over its whole life; 404 when the team has no such run."""
    now = now or timezone.now()
    try:
        run = (Run.objects.filter(team=team, pk=uuid.UUID(str(run_id)))
               .select_related("project").first())
    except ValueError:
        run = None
    if run is None:
        raise NotFound(f"No run '{run_id}' in team '{team.slug}'.")
    pieces, redone = _load([run], now)
    return RunUsage(run, _with_idle(accounting.tally(pieces[run.pk]), _idle([run.pk])[run.pk]),
                    redone[run.pk])


def _hours(seconds: dict[str, float]) -> dict[str, float]:
    return {k: v / 3600.0 for k, v in seconds.items()}


def usage_dict(usage: Usage, hourly: dict[str, float]) -> dict[str, Any]:
    """A usage as the API and page show it: GPU- and CPU-hours per part (``allocated`` is
    their sum), the idle shares of useful, GPU-hours per type, goodput and cost."""
    money = accounting.cost(usage, hourly)
    return {
        "gpu_hours": {"allocated": usage.allocated_gpu_s / 3600.0,
                      **_hours({p: usage.gpu_s[p] for p in PARTS}),
                      **_hours({p: usage.idle_gpu_s[p] for p in IDLE_PARTS})},
        "cpu_hours": {"allocated": usage.allocated_cpu_s / 3600.0,
                      **_hours({p: usage.cpu_s[p] for p in PARTS}),
                      **_hours({p: usage.idle_cpu_s[p] for p in IDLE_PARTS})},
        "gpu_hours_by_type": _hours(dict(sorted(usage.gpu_s_by_type.items()))),
        "goodput": usage.goodput,
        "cost": {"gpu": money.gpu, "cpu": money.cpu, "total": money.total,
                 "unpriced_gpu_hours": _hours(money.unpriced_gpu_s)},
    }


def run_row(row: RunUsage, hourly: dict[str, float]) -> dict[str, Any]:
    run = row.run
    return {"id": str(run.pk), "name": run.name, "kind": run.kind, "status": run.status,
            "project": run.project.slug, "redone_steps": row.redone_steps,
            **usage_dict(row.usage, hourly)}
