"""Reads and small pure helpers behind the dashboard pages: the runs table query (filters,
sort, a constant number of queries per page), config flattening and diffing for compare,
report comparison with regressions, and the run page's side panels."""

from __future__ import annotations

import contextlib
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from django.contrib.auth import get_user_model
from django.core.paginator import Page, Paginator
from django.db.models import Q, QuerySet
from django.urls import reverse

from apps.environments.models import Environment
from apps.lineage.models import ArtifactType, LineageEdge
from apps.projects.models import Project
from apps.runs.models import Run, RunKind, RunStatus, RunTag
from apps.runs.validation import TAG_PATTERN
from apps.teams.models import Team

PAGE_SIZE = 50
MAX_TAG_CHOICES = 500
MAX_COMPARE = 10
# Sort keys offered in the table header: public name -> ORDER BY fields.
SORTS: dict[str, tuple[str, ...]] = {
    "created": ("created_at",),
    "name": ("name", "created_at"),
    "kind": ("kind", "created_at"),
    "status": ("status", "created_at"),
    "updated": ("updated_at",),
    "priority": ("priority", "created_at"),
}


@dataclass
class RunFilters:
    """What the runs table is narrowed to; unknown values are ignored, not errors, so a
    stale bookmarked URL still shows a table."""

    kind: str = ""
    status: str = ""
    project: str = ""
    environment: str = ""
    creator: str = ""
    tag: str = ""
    q: str = ""
    sort: str = "-created"
    page: int = 1
    cols: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()  # "name:last" | "name:best"
    group: str = ""

    @classmethod
    def from_query(cls, params: Any) -> RunFilters:
        sort = params.get("sort") or "-created"
        if sort.lstrip("-") not in SORTS:
            sort = "-created"
        try:
            page = max(1, int(params.get("page") or 1))
        except ValueError:
            page = 1
        kind = params.get("kind") or ""
        status = params.get("status") or ""
        tag = params.get("tag") or ""
        getlist = getattr(params, "getlist", lambda k: [params[k]] if k in params else [])
        cols = tuple(dict.fromkeys(c for c in getlist("col") if c in OPTIONAL_COLUMNS))
        metrics = tuple(dict.fromkeys(m for m in (v[:260] for v in getlist("m"))
                                      if METRIC_COLUMN.fullmatch(m)))[:MAX_METRIC_COLUMNS]
        group = params.get("group") or ""
        return cls(
            cols=cols, metrics=metrics, group=group if group in GROUPS else "",
            kind=kind if kind in RunKind.values else "",
            status=status if status in RunStatus.values else "",
            project=(params.get("project") or "")[:64],
            environment=(params.get("environment") or "")[:64],
            creator=(params.get("creator") or "")[:150],
            tag=tag if TAG_PATTERN.fullmatch(tag) else "",
            q=(params.get("q") or "").strip()[:200],
            sort=sort,
            page=page,
        )

    def active(self) -> bool:
        return any((self.kind, self.status, self.project, self.environment, self.creator,
                    self.tag, self.q))

    def query(self, **changes: Any) -> str:
        """The query string of this filter with ``changes`` applied (for sort/page links)."""
        from urllib.parse import urlencode

        values = {"kind": self.kind, "status": self.status, "project": self.project,
                  "environment": self.environment, "creator": self.creator, "tag": self.tag,
                  "q": self.q, "group": self.group,
                  "sort": self.sort, "page": self.page, "col": list(self.cols),
                  "m": list(self.metrics), **changes}
        clean = {k: v for k, v in values.items()
                 if v and not (k == "sort" and v == "-created") and not (k == "page" and v == 1)}
        return urlencode(clean, doseq=True)

    def columns(self) -> list[Column]:
        """The table's columns: name and status always, the chosen optional ones (or the
        defaults) in their fixed order, then the metric columns."""
        chosen = self.cols or DEFAULT_COLUMNS
        out = [Column("name", "Run", "name")]
        out += [Column(k, OPTIONAL_COLUMNS[k][0], OPTIONAL_COLUMNS[k][1])
                for k in OPTIONAL_COLUMNS if k in chosen or k == "status"]
        for m in self.metrics:
            name, agg = m.rsplit(":", 1)
            best = "best, min" if lower_is_better(name) else "best, max"
            label = f"{name} ({best if agg == 'best' else 'last'})"
            out.append(Column(m, label, None, metric=name, agg=agg))
        return out

    @property
    def without_tag(self) -> str:
        """This filter's query string less its tag (a tag chip's link appends its own)."""
        return self.query(tag="", page=1)


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    sort: str | None
    metric: str | None = None
    agg: str | None = None


# Optional columns of the runs table: key -> (label, sort key or None), in display order.
OPTIONAL_COLUMNS: dict[str, tuple[str, str | None]] = {
    "kind": ("Kind", "kind"), "project": ("Project", None),
    "environment": ("Environment", None), "status": ("Status", "status"),
    "pool": ("Pool", None), "priority": ("Priority", "priority"),
    "attempt": ("Attempts", None), "duration": ("Duration", None),
    "created": ("Created", "created"), "updated": ("Updated", "updated"),
    "creator": ("Creator", None),
}
DEFAULT_COLUMNS = ("kind", "project", "environment", "status", "pool", "priority", "created",
                   "updated", "creator")
METRIC_COLUMN = re.compile(r"[^\s:]{1,200}:(last|best)")
MAX_METRIC_COLUMNS = 6
GROUPS = {"kind": "Kind", "environment": "Environment", "tag": "Tag", "project": "Project"}
# A grouped page is ordered by the group first, so a group's runs sit together.
GROUP_ORDER = {"kind": ("kind",), "project": ("project__slug",),
               "environment": ("environment_version__environment__slug",
                               "environment_version__number")}
CSV_MAX_ROWS = 10_000


def runs_table_queryset(team: Team, filters: RunFilters) -> QuerySet[Run]:
    """One query for the rows (joins, no per-row lookups; tags come from the run's own
    display copy); the page adds one COUNT. A tag filter is an indexed ``RunTag`` subquery,
    so it stays one query too."""
    runs = Run.objects.filter(team=team).select_related(
        "project", "environment_version__environment", "created_by"
    ).only(
        "id", "name", "kind", "status", "pool", "priority", "attempt", "created_at",
        "updated_at", "project__slug", "environment_version__number",
        "environment_version__environment__slug", "created_by__username", "tags",
        "started_at", "finished_at", "max_attempts",
    )
    if filters.kind:
        runs = runs.filter(kind=filters.kind)
    if filters.status:
        runs = runs.filter(status=filters.status)
    if filters.project:
        runs = runs.filter(project__slug=filters.project)
    if filters.environment:
        runs = runs.filter(environment_version__environment__slug=filters.environment)
    if filters.creator:
        runs = runs.filter(created_by__username=filters.creator)
    if filters.tag:
        runs = runs.filter(pk__in=RunTag.objects.filter(team=team, tag=filters.tag)
                           .values("run_id"))
    if filters.q:
        query = Q(name__icontains=filters.q)
        with contextlib.suppress(ValueError):
            query |= Q(pk=uuid.UUID(filters.q))
        runs = runs.filter(query)
    desc = filters.sort.startswith("-")
    order = [("-" if desc else "") + f for f in SORTS[filters.sort.lstrip("-")]]
    return runs.order_by(*GROUP_ORDER.get(filters.group, ()), *order, "-pk" if desc else "pk")


@dataclass
class RunGroup:
    key: str
    runs: list[Run]


def group_rows(runs: list[Run], group: str) -> list[RunGroup]:
    """A page's rows under their group headings, in page order (a run with several tags
    appears under each; one with none under "no tag")."""
    if not group:
        return [RunGroup("", runs)]
    groups: dict[str, list[Run]] = {}
    for run in runs:
        if group == "tag":
            keys = list(run.tags or []) or ["(no tag)"]
        elif group == "kind":
            keys = [run.kind]
        elif group == "project":
            keys = [run.project.slug]
        else:
            ev = run.environment_version
            keys = [f"{ev.environment.slug} v{ev.number}" if ev else "(no environment)"]
        for key in keys:
            groups.setdefault(key, []).append(run)
    return [RunGroup(k, v) for k, v in groups.items()]


def attach_metric_cells(runs: list[Run], columns: list[Column]) -> None:
    """``run.cells[column.key]``: the last value (at the series' last step) or the best one
    (min or max by the metric's direction) of each metric column — two queries per metric
    column, whatever the page size."""
    from django.db.models import Max, Min

    from apps.metrics.models import MetricPoint, MetricSeries

    ids = [r.pk for r in runs]
    for run in runs:
        run.cells = {}
    for col in columns:
        if col.metric is None or not ids:
            continue
        found: dict[Any, float] = {}
        if col.agg == "best":
            agg = Min("value") if lower_is_better(col.metric) else Max("value")
            for row in MetricPoint.objects.filter(run_id__in=ids, name=col.metric).values(
                    "run_id").annotate(v=agg).order_by():
                found[row["run_id"]] = row["v"]
        else:
            last = dict(MetricSeries.objects.filter(run_id__in=ids, name=col.metric)
                        .values_list("run_id", "last_step"))
            for run_id, step, value in MetricPoint.objects.filter(
                    run_id__in=list(last), name=col.metric,
                    step__in=set(last.values())).order_by("id").values_list(
                        "run_id", "step", "value"):
                if last.get(run_id) == step:
                    found[run_id] = value
        for run in runs:
            run.cells[col.key] = found.get(run.pk)


def metric_names_for_team(team: Team, limit: int = 300) -> list[str]:
    """Metric names the team's runs report, for the column chooser (one query)."""
    from apps.metrics.models import MetricSeries

    return list(MetricSeries.objects.filter(run__team=team).order_by("name")
                .values_list("name", flat=True).distinct()[:limit])


def runs_page(team: Team, filters: RunFilters) -> Page:
    return Paginator(runs_table_queryset(team, filters), PAGE_SIZE).get_page(filters.page)


@dataclass
class FilterChoices:
    projects: list[str]
    environments: list[str]
    creators: list[str]
    tags: list[str] = field(default_factory=list)


def filter_choices(team: Team) -> FilterChoices:
    """Four small queries, independent of how many runs the team has (the tag list reads
    the (team, tag, run) index, capped at MAX_TAG_CHOICES)."""
    user_model = get_user_model()
    return FilterChoices(
        projects=list(Project.objects.filter(team=team).order_by("slug")
                      .values_list("slug", flat=True)),
        environments=list(Environment.objects.filter(team=team).order_by("slug")
                          .values_list("slug", flat=True)),
        creators=list(user_model.objects.filter(memberships__team=team)
                      .order_by("username").values_list("username", flat=True)),
        tags=list(RunTag.objects.filter(team=team).order_by("tag")
                  .values_list("tag", flat=True).distinct()[:MAX_TAG_CHOICES]),
    )


# --- compare ---------------------------------------------------------------------------


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts to dotted keys; lists and scalars are leaves (a list is one setting)."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key in sorted(value):
            out.update(flatten(value[key], f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix or "(root)": value}


MISSING = object()


@dataclass
class ConfigRow:
    key: str
    values: list[Any]
    differs: bool


def config_table(configs: list[dict[str, Any]]) -> list[ConfigRow]:
    """Every flattened key across the configs; ``differs`` when any two runs disagree
    (a key one run lacks counts as a difference)."""
    flat = [flatten(c) for c in configs]
    keys = sorted(set().union(*flat)) if flat else []
    rows = []
    for key in keys:
        values = [f.get(key, MISSING) for f in flat]
        differs = any(v != values[0] or type(v) is not type(values[0]) for v in values[1:])
        rows.append(ConfigRow(key, values, differs))
    return rows


# Which way is better, read from a report key's path (``summary.latency_s.mean``): the
# segment nearest the end that says so wins; aggregate names (mean, p95, …) say nothing.
HIGHER_IS_BETTER = re.compile(r"(_per_s$|per_second|throughput|pass|accuracy|(^|_)acc$|reward|"
                              r"score|success|correct|win_rate|precision|recall|f1)")
LOWER_IS_BETTER = re.compile(r"(loss|error|fail|latency|time|elapsed|perplexity|timeout|"
                             r"duration|_s$|_ms$|tokens|cost|quarantined|rejected|dropped|"
                             r"stale|lag|regret|kl$)")
AGGREGATES = frozenset({"mean", "avg", "median", "p50", "p90", "p95", "p99", "max", "min",
                        "std", "total", "sum", "count", "value", "last", "first"})
REGRESSION_TOLERANCE = 0.01


def lower_is_better(key: str) -> bool:
    """True for keys where a smaller value is the better one (times, losses, errors, tokens
    spent per task); throughput, pass rates, rewards and anything unrecognised go up."""
    for segment in reversed(key.lower().split(".")):
        if segment in AGGREGATES or segment.isdigit():
            continue
        if HIGHER_IS_BETTER.search(segment):
            return False
        if LOWER_IS_BETTER.search(segment):
            return True
    return False


@dataclass
class ReportCell:
    value: Any
    regression: bool = False
    improvement: bool = False


@dataclass
class ReportRow:
    key: str
    cells: list[ReportCell] = field(default_factory=list)
    lower_better: bool = False


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def report_table(reports: list[dict[str, Any] | None],
                 baseline: int | None = None) -> list[ReportRow]:
    """Numeric leaves of each report side by side against a baseline run (the chosen one,
    else the first with a report). A value worse than the baseline's by more than 1%
    (relative), in the metric's own direction (``lower_is_better``), is a regression."""
    flat = [flatten(r) if r else {} for r in reports]
    keys = sorted({k for f in flat for k, v in f.items() if _number(v) is not None})
    if baseline is None or not (0 <= baseline < len(reports)) or not reports[baseline]:
        baseline = next((i for i, r in enumerate(reports) if r), None)
    rows = []
    for key in keys:
        row = ReportRow(key, lower_better=lower_is_better(key))
        base = _number(flat[baseline].get(key)) if baseline is not None else None
        for i, f in enumerate(flat):
            value = _number(f.get(key))
            cell = ReportCell(f.get(key, MISSING) if reports[i] else MISSING)
            if value is not None and base is not None and i != baseline:
                delta = (base - value) if row.lower_better else (value - base)
                scale = max(abs(base), 1e-12)
                cell.regression = delta / scale < -REGRESSION_TOLERANCE
                cell.improvement = delta / scale > REGRESSION_TOLERANCE
            row.cells.append(cell)
        rows.append(row)
    return rows


def parse_run_ids(values: list[str]) -> list[str]:
    """Valid, distinct run ids in the order given (bad ones dropped), at most MAX_COMPARE."""
    seen: list[str] = []
    for raw in values:
        for part in raw.split(","):
            try:
                value = str(uuid.UUID(part.strip()))
            except ValueError:
                continue
            if value not in seen:
                seen.append(value)
    return seen


# --- run page panels ---------------------------------------------------------------------


@dataclass
class Neighbour:
    direction: str  # "upstream" | "downstream"
    relation: str
    type: str
    id: str
    label: str
    run_id: str | None = None
    url: str | None = None


def lineage_neighbours(run: Run) -> list[Neighbour]:
    """Direct lineage edges of a run, labelled for people (two queries plus one per
    artifact type present, not per edge)."""
    ident = str(run.pk)
    edges = list(LineageEdge.objects.filter(team_id=run.team_id).filter(
        Q(source_type=ArtifactType.RUN, source_id=ident)
        | Q(target_type=ArtifactType.RUN, target_id=ident)
    ).order_by("pk"))
    rows: list[Neighbour] = []
    for e in edges:
        if e.target_type == ArtifactType.RUN and e.target_id == ident:
            rows.append(Neighbour("upstream", e.relation, e.source_type, e.source_id,
                                  e.source_id))
        else:
            rows.append(Neighbour("downstream", e.relation, e.target_type, e.target_id,
                                  e.target_id))
    _label(run, rows)
    return rows


def _label(run: Run, rows: list[Neighbour]) -> None:
    from apps.datasets.models import DatasetVersion
    from apps.environments.models import EnvironmentVersion
    from apps.runs.models import Checkpoint

    def ids(kind: str) -> list[str]:
        return [r.id for r in rows if r.type == kind]

    labels: dict[tuple[str, str], str] = {}
    urls: dict[tuple[str, str], str] = {}
    runs_found: set[str] = set()
    team_slug = run.team.slug
    if ids(ArtifactType.DATASET_VERSION):
        for v in DatasetVersion.objects.filter(
            dataset__team_id=run.team_id, digest__in=ids(ArtifactType.DATASET_VERSION)
        ).select_related("dataset"):
            labels[(ArtifactType.DATASET_VERSION, v.digest)] = (
                f"dataset {v.dataset.slug} v{v.number}")
            urls[(ArtifactType.DATASET_VERSION, v.digest)] = reverse(
                "dataset-page", args=[team_slug, v.dataset.slug])
    if ids(ArtifactType.ENVIRONMENT_VERSION):
        for v in EnvironmentVersion.objects.filter(
            environment__team_id=run.team_id, digest__in=ids(ArtifactType.ENVIRONMENT_VERSION)
        ).select_related("environment"):
            labels[(ArtifactType.ENVIRONMENT_VERSION, v.digest)] = (
                f"environment {v.environment.slug} v{v.number}")
            urls[(ArtifactType.ENVIRONMENT_VERSION, v.digest)] = reverse(
                "environment-version-page", args=[team_slug, v.environment.slug, v.digest])
    ckpt_ids = [i for i in ids(ArtifactType.CHECKPOINT) if i.isdigit()]
    if ckpt_ids:
        for c in Checkpoint.objects.filter(team_id=run.team_id, pk__in=ckpt_ids):
            labels[(ArtifactType.CHECKPOINT, str(c.pk))] = f"checkpoint @ step {c.step}"
            urls[(ArtifactType.CHECKPOINT, str(c.pk))] = (
                reverse("run-page", args=[team_slug, str(c.run_id)]) + "#ckpt-h")
    run_ids = ids(ArtifactType.RUN)
    if run_ids:
        for r in Run.objects.filter(team_id=run.team_id, pk__in=run_ids).only("id", "name",
                                                                            "kind"):
            labels[(ArtifactType.RUN, str(r.pk))] = f"{r.kind} run {r.name or str(r.pk)[:8]}"
            runs_found.add(str(r.pk))
    for r in rows:
        r.label = labels.get((r.type, r.id), f"{r.type} {r.id[:16]}")
        if r.type == ArtifactType.RUN and r.id in runs_found:
            r.run_id = r.id
            r.url = reverse("run-page", args=[team_slug, r.id])
        elif (r.type, r.id) in urls:
            r.url = urls[(r.type, r.id)]


SAMPLE_SORTS = {"reward": ("reward", "id"), "-reward": ("-reward", "id"), "id": ("id",)}


def sample_steps(run: Run, limit: int = 500) -> list[int]:
    return list(run.samples.order_by("-step").values_list("step", flat=True).distinct()[:limit])


def step_samples(run: Run, step: int, sort: str, limit: int = 200) -> QuerySet:
    order = SAMPLE_SORTS.get(sort, SAMPLE_SORTS["-reward"])
    rows = run.samples.filter(step=step)
    if order[0].lstrip("-") == "reward":
        from django.db.models import F

        expr = F("reward").desc(nulls_last=True) if order[0].startswith("-") else \
            F("reward").asc(nulls_last=True)
        return rows.order_by(expr, "id")[:limit]
    return rows.order_by(*order)[:limit]


# --- run page: sections, checkpoints, report ------------------------------------------------

CHART_POINTS = 2000  # points per chart the run page loads (a chart is < 1,000 px wide)
REPORT_ROWS = 200
CHECKPOINT_KEYS = ("eval/reward_mean", "reward_mean", "reward/mean", "loss", "kl",
                   "eval/mean_reward")
MAX_CHECKPOINT_KEYS = 8


def sections_for(run: Run) -> dict[str, bool]:
    """Which run-page sections apply to a run of this kind (the rest are left out)."""
    kind = run.kind
    return {"experts": kind == RunKind.TRAIN, "checkpoints": kind == RunKind.TRAIN,
            "samples": kind in (RunKind.TRAIN, RunKind.EVAL)}


def checkpoints_with_evals(run: Run) -> list[Any]:
    """The run's checkpoints, each with ``evals``: the eval runs that started from it (two
    queries)."""
    rows = list(run.checkpoints.order_by("step"))
    by_id = {c.pk: c for c in rows}
    for c in rows:
        c.evals = []
    for r in Run.objects.filter(team_id=run.team_id, kind=RunKind.EVAL,
                                base_checkpoint_id__in=by_id).only(
                                    "id", "name", "base_checkpoint_id").order_by("created_at"):
        by_id[r.base_checkpoint_id].evals.append(r)
    return rows


def checkpoint_keys(checkpoints: list[Any], wanted: list[str]) -> tuple[list[str], list[str]]:
    """(every metric key the checkpoints carry, the keys to show): the ones asked for that
    exist, else the usual headline metrics present, else the first few."""
    every = sorted({k for c in checkpoints for k in (c.metrics or {})})
    chosen = [k for k in wanted if k in every][:MAX_CHECKPOINT_KEYS * 4]
    if not chosen:
        chosen = [k for k in CHECKPOINT_KEYS if k in every] or every[:4]
    return every, chosen


def report_rows(report: dict[str, Any] | None) -> list[tuple[str, Any]]:
    """A report's scalar leaves (and short lists) as (dotted key, value), for the report
    section of eval, profile, QC and synthesis run pages."""
    if not isinstance(report, dict):
        return []
    out = []
    for key, value in flatten(report).items():
        if isinstance(value, list) and (len(value) > 20 or any(isinstance(v, dict | list)
                                                               for v in value)):
            value = f"[{len(value)} items]"
        out.append((key, value))
    return out


def headline(summary: Any) -> dict[str, Any] | None:
    """A report's ``summary`` block, flattened, for the run summary card."""
    if not isinstance(summary, dict):
        return None
    return {k: v for k, v in flatten(summary).items()
            if isinstance(v, int | float | str | bool) or v is None}
