from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from django.db.models import Max, Prefetch, QuerySet
from django.utils import timezone

from apps.core.exceptions import DomainError, InvalidInput, NotFound
from apps.datasets.models import DatasetVersion
from apps.environments.models import EnvironmentVersion
from apps.metrics.models import MetricBatch, MetricSeries
from apps.runs import goodput, objects
from apps.runs.goodput import Goodput
from apps.runs.models import FINAL_STATUSES, Checkpoint, Run, RunStatus
from apps.scheduling.models import Allocation
from apps.teams.models import Team
from workers.protocol import ClaimedRun, PinnedEnvironment


def runs_with_relations(queryset: QuerySet[Run]) -> QuerySet[Run]:
    return queryset.select_related(
        "project", "environment_version__environment", "base_checkpoint"
    ).prefetch_related("pins__dataset_version__dataset",
                       "environment_pins__environment_version__environment", "attempts",
                       Prefetch("allocations", to_attr="active_allocations",
                                queryset=Allocation.objects.filter(released_at__isnull=True)
                                .select_related("node")))


def active_allocations(run: Run) -> list[Allocation]:
    """The run's allocations that hold resources (prefetched by runs_with_relations)."""
    found = getattr(run, "active_allocations", None)
    if found is None:
        found = list(Allocation.objects.filter(run=run, released_at__isnull=True)
                     .select_related("node"))
    return list(found)


def run_for_page(team: Team, run_id: str | None) -> Run | None:
    """The team's run with everything its page shows, or None (a malformed id too)."""
    if run_id is None:
        return None
    return runs_with_relations(Run.objects.filter(team=team)).select_related(
        "created_by", "base_checkpoint__run").filter(pk=run_id).first()


def run_for_worker(*, team_id: int | None, run: str, related: tuple[str, ...] = ()) -> Run:
    """The run a worker token names in its URL: a team token sees only its team's runs, an
    operator token (team_id None) every run; a malformed id and a foreign run are the same 404."""
    try:
        run_id = uuid.UUID(run)
    except ValueError as exc:
        raise NotFound(f"No run '{run}'.") from exc
    queryset = Run.objects.select_related(*related) if related else Run.objects.all()
    if team_id is not None:
        queryset = queryset.filter(team_id=team_id)
    obj = queryset.filter(pk=run_id).first()
    if obj is None:
        raise NotFound(f"No run '{run}'.")
    return obj


def report(run: Run) -> dict[str, Any]:
    """The run's report, read through the run row (see :mod:`apps.runs.objects`)."""
    return objects.read_json(run, run.report_uri)


def report_or_none(run: Run) -> dict[str, Any] | None:
    """The run's report as an object, or None (none yet, unreadable, or not an object):
    for pages and comparisons that show what there is."""
    if not run.report_uri:
        return None
    try:
        value = report(run)
    except (DomainError, OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def resolve_checkpoint(*, team: Team, ref: str) -> Checkpoint:
    """``run:<run id>`` (its latest checkpoint), ``run:<run id>@<step>`` or
    ``checkpoint:<id>``, in ``team`` only; the checkpoint must live in the object store so
    any worker can fetch it."""
    kind, _, rest = ref.partition(":")
    found: Checkpoint | None = None
    if kind == "checkpoint" and rest.isdigit():
        found = Checkpoint.objects.select_related("run").filter(team=team, pk=int(rest)).first()
    elif kind == "run":
        run_part, _, step = rest.partition("@")
        try:
            run_id = uuid.UUID(run_part)
        except ValueError:
            run_id = None
        if run_id is None or not Run.objects.filter(team=team, pk=run_id).exists():
            raise InvalidInput(f"base_model '{ref[:120]}': run '{run_part[:60]}' not found in "
                               f"team '{team.slug}'.", details={"base_model": [ref[:120]]})
        if step and not step.isdigit():
            raise InvalidInput(f"base_model '{ref[:120]}': the step after '@' must be a whole "
                               "number.", details={"base_model": [ref[:120]]})
        rows = Checkpoint.objects.select_related("run").filter(team=team, run_id=run_id)
        found = (rows.filter(step=int(step)) if step else
                 rows.filter(pruned_at__isnull=True).order_by("-step")).first()
    if found is None:
        raise InvalidInput(f"base_model '{ref[:120]}' matches no checkpoint in team "
                           f"'{team.slug}'.", details={"base_model": [ref[:120]]})
    if found.pruned_at is not None:
        raise InvalidInput(
            f"base_model '{ref[:120]}': checkpoint {found.pk} (run {found.run_id}, step "
            f"{found.step}) was pruned by its run's checkpoint.keep; its object is deleted. "
            "Pick a kept checkpoint (GET …/runs/<id>/checkpoints).",
            details={"base_model": [ref[:120]]})
    # The URI must be one the checkpoint's own run wrote (its team's and run's prefix): a row
    # that points anywhere else, e.g. at another team's objects, is never pinned.
    if found.team_id != team.pk or not objects.owns(found.run, found.uri):
        raise InvalidInput(
            f"Checkpoint {found.pk} (run {found.run_id}, step {found.step}) does not lie under "
            f"its run's own objects in the object store, so it cannot be used: "
            f"{found.uri[:200]}",
            code="uri_outside_run", details={"base_model": [ref[:120]]},
        )
    return found


def metric_watermarks(run: Run) -> tuple[int, dict[str, int]]:
    """The last metric batch seq and each series' last step: a retried attempt continues
    the batch numbering and drops points its replay would store twice."""
    seq = MetricBatch.objects.filter(run=run).aggregate(m=Max("seq"))["m"] or 0
    steps = dict(MetricSeries.objects.filter(run=run).values_list("name", "last_step"))
    return seq, steps


def _digests(value: Any) -> set[str]:
    """Dataset digests an environment spec refers to (``{"dataset", "digest"}`` objects)."""
    if isinstance(value, dict):
        found = set().union(*(_digests(v) for v in value.values())) if value else set()
        digest = value.get("digest")
        if "dataset" in value and isinstance(digest, str) and len(digest) == 64:
            found.add(digest)
        return found
    if isinstance(value, list):
        return set().union(*(_digests(v) for v in value)) if value else set()
    return set()


def _worker_environment(run: Run, version: EnvironmentVersion) -> PinnedEnvironment:
    """An environment version as a worker loads it: its spec, the object URIs of datasets
    the spec reads, and the task ids its QC report quarantined (left out of training)."""
    digests = _digests(version.spec)
    uris = dict(DatasetVersion.objects.filter(dataset__team_id=run.team_id, digest__in=digests)
                .values_list("digest", "uri")) if digests else {}
    report = version.qc_report if isinstance(version.qc_report, dict) else {}
    quarantined = report.get("quarantined_ids")
    return PinnedEnvironment(
        environment=version.environment.slug, number=version.number, digest=version.digest,
        spec=version.spec, qc_status=version.qc_status, dataset_uris=uris,
        quarantined_ids=[str(i) for i in quarantined] if isinstance(quarantined, list) else [])


def claimed_run(run: Run) -> ClaimedRun:
    """What a worker needs to execute a run: the frozen document plus object URIs."""
    ev = run.environment_version
    metric_seq, metric_steps = metric_watermarks(run)
    base = run.base_checkpoint
    return ClaimedRun(
        id=str(run.pk),
        team=run.team.slug,
        project=run.project.slug,
        kind=run.kind,
        status=run.status,
        pool=run.pool,
        attempt=run.attempt,
        max_attempts=run.max_attempts,
        config=run.config,
        lease_id=run.lease_id,
        lease_expires_at=run.lease_expires_at.isoformat() if run.lease_expires_at else None,
        lease_epoch=run.lease_epoch,
        # Every object the run reports must lie under this key prefix of the object store.
        object_prefix=objects.prefix_of(run),
        datasets={
            pin.alias: {
                "dataset": pin.dataset_version.dataset.slug,
                "digest": pin.dataset_version.digest,
                "number": pin.dataset_version.number,
                "uri": pin.dataset_version.uri,
                "record_count": pin.dataset_version.record_count,
            }
            for pin in run.pins.select_related("dataset_version__dataset")
        },
        environment=(
            {"environment": ev.environment.slug, "digest": ev.digest, "spec": ev.spec}
            if ev else None
        ),
        environments=[
            _worker_environment(run, pin.environment_version)
            for pin in run.environment_pins.select_related("environment_version__environment")
        ],
        base_checkpoint=(
            {"id": base.pk, "run": str(base.run_id), "step": base.step, "uri": base.uri}
            if base else None
        ),
        checkpoints=[
            {"step": c.step, "uri": c.uri}
            for c in run.checkpoints.filter(pruned_at__isnull=True).order_by("step")
        ],
        metric_seq=metric_seq,
        metric_steps=metric_steps,
        resources=run.resources or {},
        # Sorted, as dispatch does: the first is the node whose queue got the message.
        nodes=sorted(a.node.name for a in run.allocations.filter(released_at__isnull=True)
                     .select_related("node")),
    )


def worker_view(run: Run) -> dict[str, Any]:
    """The claim as JSON (:class:`workers.protocol.ClaimedRun`)."""
    return claimed_run(run).model_dump(mode="json")


def environment_eval_runs(version: EnvironmentVersion, limit: int) -> list[Run]:
    """The version's succeeded eval runs that left a report, newest first."""
    return list(Run.objects.filter(team_id=version.team_id, kind="eval",
                                   environment_pins__environment_version=version,
                                   status=RunStatus.SUCCEEDED)
                .exclude(report_uri="").select_related("base_checkpoint__run")
                .order_by("-created_at")[:limit])


def environment_eval_reports(version: EnvironmentVersion, limit: int = 50) -> list[dict[str, Any]]:
    """The version's evaluations, newest first: each succeeded eval run with its report's
    policy and summary (the full report is the run's report)."""
    rows = []
    for run in environment_eval_runs(version, limit):
        try:
            report = objects.read_json(run, run.report_uri)
        except DomainError as exc:
            report = {"error": f"report unreadable: {exc.message}"}
        rows.append({"run": str(run.pk), "name": run.name, "created_at": run.created_at,
                     "report_uri": run.report_uri, "policy": report.get("policy"),
                     "split": report.get("split"), "k": report.get("k"),
                     "summary": report.get("summary"), "error": report.get("error")})
    return rows


def environment_version_runs(version: EnvironmentVersion, limit: int) -> list[Run]:
    """The version's QC and eval runs, newest first."""
    return list(Run.objects.filter(team_id=version.team_id, kind__in=("qc", "eval"),
                                   environment_pins__environment_version=version)
                .select_related("created_by").order_by("-created_at")[:limit])


def runs_by_id(team: Team, ids: list[str]) -> dict[str, Run]:
    """The team's runs among ``ids`` (UUID strings), keyed by id: for labelling graphs."""
    return {str(r.pk): r for r in Run.objects.filter(team=team, pk__in=ids)}


def checkpoints_by_id(team: Team, ids: list[int]) -> dict[str, Checkpoint]:
    """The team's checkpoints among ``ids``, keyed by id as a string."""
    return {str(c.pk): c for c in Checkpoint.objects.filter(run__team=team, pk__in=ids)}


def pending_by_queue(visible_team_ids: set[int] | None) -> list[dict[str, Any]]:
    """Queued runs by queue (one per team) in queue order, with why each waits. Runs of teams
    outside ``visible_team_ids`` (None: all) are counted, not listed."""
    rows = (Run.objects.filter(status=RunStatus.QUEUED).select_related("team")
            .prefetch_related(Prefetch("allocations", to_attr="active_allocations",
                                       queryset=Allocation.objects.filter(
                                           released_at__isnull=True).select_related("node")))
            .order_by("team__slug", "queue_position", "queued_at", "id"))
    out: dict[str, dict[str, Any]] = {}
    for run in rows:
        entry = out.setdefault(run.team.slug, {"queue": run.team.slug, "pending": 0,
                                               "admitted": 0, "runs": []})
        admitted = bool(run.active_allocations)  # type: ignore[attr-defined]
        entry["admitted" if admitted else "pending"] += 1
        if visible_team_ids is not None and run.team_id not in visible_team_ids:
            continue
        entry["runs"].append({
            "id": str(run.pk), "name": run.name, "kind": run.kind, "pool": run.pool,
            "priority_class": run.priority_class, "resources": run.resources,
            "admitted": admitted, "wait_reason": run.wait_reason,
            "nodes": sorted(a.node.name for a in run.active_allocations),  # type: ignore[attr-defined]
            "queue_position": run.queue_position,
            "estimated_start_at": run.estimated_start_at, "queued_at": run.queued_at})
    return list(out.values())


def _seconds(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def run_goodput(run: Run, now: datetime | None = None) -> Goodput:
    """The run's goodput and where the rest of its wall time went (:mod:`apps.runs.goodput`),
    from its attempts (prefetched by runs_with_relations) and its resumable checkpoints'
    registration times."""
    attempts = [goodput.Attempt(number=a.number, outcome=a.outcome,
                                claimed_at=a.claimed_at.timestamp(),
                                ended_at=_seconds(a.ended_at), started_at=_seconds(a.started_at),
                                resume_step=a.resume_step)
                for a in run.attempts.all()]
    marks = [goodput.CheckpointMark(step=step, created_at=created.timestamp())
             for step, created in Checkpoint.objects.filter(run=run, resumable=True)
             .values_list("step", "created_at")] if attempts else []
    finished = run.finished_at if run.status in FINAL_STATUSES else None
    return goodput.compute(attempts, marks, now=(now or timezone.now()).timestamp(),
                           finished_at=_seconds(finished))
