"""Dashboard pages (server-rendered, htmx for partial swaps, a websocket for live data).

Pages read through ``apps.runs.dashboard`` and write through the same services the API
uses, so a page never accepts what the API would refuse."""

from __future__ import annotations

import json
import uuid
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone

from apps.core.actor import Actor
from apps.core.exceptions import DomainError
from apps.filtering import selectors as filter_selectors
from apps.projects import selectors as project_selectors
from apps.runs import dashboard, selectors, services
from apps.runs.forms import (
    DEFAULT_KIND,
    PRESETS,
    LaunchForm,
    initial_from_preset,
    initial_from_run,
    kind_starters,
)
from apps.runs.models import EventLevel, Run, RunKind, RunStatus
from apps.runs.selectors import runs_with_relations
from apps.runs.summary import run_summary
from apps.teams.models import Membership, Team
from apps.teams.pages import page_context, team_page
from apps.teams.selectors import teams_for_user

EVENT_TAIL = 200


def _run(team_obj: Team, run: str) -> Run:
    obj = selectors.run_for_page(team_obj, _uuid(run))
    if obj is None:
        raise Http404("No such run.")
    return obj


@login_required
def home(request: HttpRequest) -> HttpResponse:
    first = teams_for_user(request.user).order_by("slug").first()
    if first is not None:
        return redirect("team-runs", team=first.slug)
    return render(request, "runs/no_team.html", {"teams": []})


def runs_table_context(team_obj: Team, membership: Membership,
                       request: HttpRequest) -> dict[str, Any]:
    filters = dashboard.RunFilters.from_query(request.GET)
    page = dashboard.runs_page(team_obj, filters)
    runs = list(page.object_list)
    columns = filters.columns()
    dashboard.attach_metric_cells(runs, columns)
    return {
        "filters": filters, "page": page, "runs": runs, "columns": columns,
        "groups": dashboard.group_rows(runs, filters.group),
        "sort_key": filters.sort.lstrip("-"), "sort_desc": filters.sort.startswith("-"),
        "now": timezone.now(),
    }


@team_page()
def team_runs(request: HttpRequest, team_obj: Team, membership: Membership) -> HttpResponse:
    if request.GET.get("format") == "csv":
        return _runs_csv(team_obj, request)
    table = runs_table_context(team_obj, membership, request)
    if request.htmx and request.htmx.target == "runs":
        return render(request, "runs/_runs_table.html",
                      page_context(request, team_obj, membership, **table))
    context = page_context(
        request, team_obj, membership, section="runs", **table,
        choices=dashboard.filter_choices(team_obj), kinds=RunKind.values,
        statuses=RunStatus.values, max_compare=dashboard.MAX_COMPARE,
        table_data={"team": team_obj.slug},
        optional_columns=dashboard.OPTIONAL_COLUMNS, group_choices=dashboard.GROUPS,
        default_columns=dashboard.DEFAULT_COLUMNS,
        metric_names=dashboard.metric_names_for_team(team_obj),
    )
    return render(request, "runs/team_runs.html", context)


def _runs_csv(team_obj: Team, request: HttpRequest) -> HttpResponse:
    """Every run the filters match (up to CSV_MAX_ROWS), in the table's columns."""
    import csv
    import io

    from apps.runs.templatetags.dashboard import duration

    filters = dashboard.RunFilters.from_query(request.GET)
    columns = filters.columns()
    runs = list(dashboard.runs_table_queryset(team_obj, filters)[: dashboard.CSV_MAX_ROWS])
    dashboard.attach_metric_cells(runs, columns)
    now = timezone.now()
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["id", *(c.label for c in columns), "tags"])
    for run in runs:
        row: list[Any] = [run.pk]
        for c in columns:
            if c.metric:
                value: Any = run.cells.get(c.key)
            elif c.key == "name":
                value = run.name
            elif c.key == "project":
                value = run.project.slug
            elif c.key == "environment":
                ev = run.environment_version
                value = f"{ev.environment.slug} v{ev.number}" if ev else ""
            elif c.key == "creator":
                value = run.created_by.username if run.created_by else ""
            elif c.key in ("created", "updated"):
                value = getattr(run, f"{c.key}_at").isoformat()
            elif c.key == "duration":
                value = duration(_seconds(run, now)) if run.started_at else ""
            else:
                value = getattr(run, c.key)
            row.append("" if value is None else value)
        row.append(" ".join(run.tags or []))
        writer.writerow(row)
    response = HttpResponse(out.getvalue(), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{team_obj.slug}-runs.csv"'
    return response


def _seconds(run: Run, now: Any) -> float:
    return ((run.finished_at or now) - run.started_at).total_seconds()


@team_page()
def team_projects(request: HttpRequest, team_obj: Team, membership: Membership
                  ) -> HttpResponse:
    rows = [(p, p.n_runs) for p in project_selectors.with_run_counts(team_obj)]
    return render(request, "runs/team_projects.html",
                  page_context(request, team_obj, membership, section="projects", rows=rows))


# --- launch --------------------------------------------------------------------------------


@team_page(refused="Viewers cannot launch runs; ask a team admin for the member role.")
def run_launch(request: HttpRequest, team_obj: Team, membership: Membership) -> HttpResponse:
    preview = None
    if request.method == "POST":
        form = LaunchForm(request.POST, team=team_obj)
        launched = form.launch(actor=Actor.of_user(request.user),
                               preview=request.POST.get("action") != "launch")
        if launched is not None and launched.run is not None:
            messages.success(request, "Run queued. It starts when a worker of its pool is free.")
            return redirect("run-page", team=team_obj.slug, run=str(launched.run.pk))
        if launched is not None:
            preview = json.dumps(launched.describe(), indent=2, sort_keys=True)
        form.mark_invalid()
    else:
        initial: dict[str, Any] = {}
        source = request.GET.get("clone")
        if source:
            initial = initial_from_run(_run(team_obj, source))
        elif request.GET.get("preset"):
            initial = initial_from_preset(request.GET["preset"]) or {}
        if request.GET.get("preset") == "profile" or initial.get("kind") == "profile":
            initial.setdefault("pool", "")
        if not initial:  # a fresh form: the most useful kind, with its starter config
            initial = {"kind": DEFAULT_KIND, "config": kind_starters()[DEFAULT_KIND],
                       "name": PRESETS["tiny-moe-sft-grpo"]["name"]}
        form = LaunchForm(initial=initial, team=team_obj)
        if "project" not in initial and form.fields["project"].choices:
            form.initial["project"] = form.fields["project"].choices[0][0]
    context = page_context(request, team_obj, membership, section="launch", form=form,
                       preview=preview, presets=PRESETS,
                       launch_data={"starters": kind_starters()},
                       clone=request.GET.get("clone") or request.POST.get("clone") or "")
    status = 400 if request.method == "POST" and form.errors else 200
    return render(request, "runs/launch.html", context, status=status)


# --- run page --------------------------------------------------------------------------------


@team_page(refused="Viewers cannot change runs.")
def run_detail(request: HttpRequest, team_obj: Team, membership: Membership,
        run: str) -> HttpResponse:
    obj = _run(team_obj, run)
    if request.method == "POST":
        return _run_action(request, team_obj, membership, obj)
    events = list(obj.events.order_by("-seq")[:EVENT_TAIL])[::-1]
    report = selectors.report_or_none(obj)
    rows = dashboard.report_rows(report) if report else []
    context = page_context(
        request, team_obj, membership, section="runs", events=events,
        config_json=json.dumps(obj.config, indent=2, sort_keys=True),
        neighbours=dashboard.lineage_neighbours(obj), levels=EventLevel.values,
        report_rows=rows[: dashboard.REPORT_ROWS],
        report_truncated=len(rows) > dashboard.REPORT_ROWS,
        page_data={"team": team_obj.slug, "run": str(obj.pk), "after": obj.event_seq,
                   "points": _points_param(request),
                   "parts": f"/t/{team_obj.slug}/runs/{obj.pk}/parts/"},
        **_live_context(obj, request, report),
    )
    return render(request, "runs/run_detail.html", context)


@team_page()
def run_parts(request: HttpRequest, team_obj: Team, membership: Membership,
        run: str) -> HttpResponse:
    """The run page's live parts (header, summary, checkpoints, attempts, samples), rendered
    again for the page to swap in when the run changes."""
    obj = _run(team_obj, run)
    context = page_context(request, team_obj, membership,
                           **_live_context(obj, request, selectors.report_or_none(obj)))
    return render(request, "runs/parts/all.html", context)


def _points_param(request: HttpRequest) -> int:
    """Points per chart the page asks the metrics API for (``?points=``, capped there)."""
    from django.conf import settings

    cap = settings.CRUCIBLE["MAX_DOWNSAMPLE_POINTS"]
    try:
        value = int(request.GET.get("points", ""))
    except ValueError:
        value = dashboard.CHART_POINTS
    return max(2, min(cap, value))


def _live_context(obj: Run, request: HttpRequest, report: dict[str, Any] | None
                  ) -> dict[str, Any]:
    checkpoints = dashboard.checkpoints_with_evals(obj) if obj.kind == RunKind.TRAIN else []
    all_keys, keys = dashboard.checkpoint_keys(checkpoints, request.GET.getlist("ckpt"))
    steps = dashboard.sample_steps(obj)
    headline = report.get("summary") if isinstance(report, dict) else None
    return {
        "run": obj, "stream_seq": obj.event_seq,
        "goodput": selectors.run_goodput(obj),
        "summary": run_summary(obj, report=dashboard.headline(headline)),
        "checkpoints": checkpoints, "ckpt_keys": keys, "ckpt_all_keys": all_keys,
        "show": dashboard.sections_for(obj),
        **_samples_context(obj, steps, request),
        "can_cancel": obj.status in services.TRANSITIONS and RunStatus.CANCELED in
        services.TRANSITIONS[obj.status],
        "can_resume": obj.status in (RunStatus.FAILED, RunStatus.CANCELED),
    }


def _samples_context(run: Run, steps: list[int], request: HttpRequest) -> dict[str, Any]:
    try:
        step = int(request.GET.get("step", ""))
    except ValueError:
        step = steps[0] if steps else None
    if step not in steps:
        step = steps[0] if steps else None
    sort = request.GET.get("sort", "-reward")
    sort = sort if sort in dashboard.SAMPLE_SORTS else "-reward"
    samples = list(dashboard.step_samples(run, step, sort)) if step is not None else []
    filter_selectors.attach_flags(run.team_id, samples)
    components = sorted({k for s in samples for k in (s.reward_components or {})})
    rl_samples = any(s.advantage is not None or s.weight_version is not None for s in samples)
    return {"sample_steps": steps, "sample_step": step, "sample_sort": sort,
            "samples": samples, "components": components, "rl_samples": rl_samples}


@team_page()
def run_samples(request: HttpRequest, team_obj: Team, membership: Membership,
        run: str) -> HttpResponse:
    obj = _run(team_obj, run)
    context = page_context(request, team_obj, membership, run=obj,
                       **_samples_context(obj, dashboard.sample_steps(obj), request))
    return render(request, "runs/_samples.html", context)


def _run_action(request: HttpRequest, team_obj: Team, membership: Membership,
                obj: Run) -> HttpResponse:
    """Cancel or resume from the run page (a POST to the page, ``op`` names the action;
    ``team_page`` refused viewers already)."""
    action = request.POST.get("op", "")
    try:
        if action == "cancel":
            services.cancel(actor=Actor.of_user(request.user), run=obj)
        elif action == "resume":
            services.resume(actor=Actor.of_user(request.user), run=obj)
        else:
            messages.error(request, f"Unknown action '{action[:40]}'; use cancel or resume.")
    except DomainError as exc:
        messages.error(request, exc.message)
    return redirect("run-page", team=team_obj.slug, run=str(obj.pk))


# --- compare ---------------------------------------------------------------------------------


@team_page()
def run_compare(request: HttpRequest, team_obj: Team, membership: Membership) -> HttpResponse:
    ids = dashboard.parse_run_ids(request.GET.getlist("run"))
    too_many = len(ids) > dashboard.MAX_COMPARE
    ids = ids[: dashboard.MAX_COMPARE]
    found = {str(r.pk): r for r in runs_with_relations(Run.objects.filter(team=team_obj,
                                                                          pk__in=ids))}
    runs = [found[i] for i in ids if i in found]
    config_rows = dashboard.config_table([r.config for r in runs])
    reports = [selectors.report_or_none(r) for r in runs]
    with_report = [i for i, r in enumerate(reports) if r]
    wanted = dashboard.parse_run_ids(request.GET.getlist("baseline"))
    baseline = next((i for i, r in enumerate(runs) if wanted and str(r.pk) == wanted[0]
                     and reports[i]), with_report[0] if with_report else None)
    context = page_context(
        request, team_obj, membership, section="runs", runs=runs, too_many=too_many,
        config_rows=config_rows, n_differ=sum(r.differs for r in config_rows),
        report_rows=dashboard.report_table(reports, baseline) if any(reports) else [],
        baseline=baseline, with_report=with_report,
        has_reports=[r is not None for r in reports], max_compare=dashboard.MAX_COMPARE,
        missing=dashboard.MISSING, show_all=request.GET.get("all") == "1",
        compare_data={"team": team_obj.slug, "points": 1000,
                      "runs": [{"id": str(r.pk), "label": r.name or str(r.pk)[:8]}
                               for r in runs]},
    )
    return render(request, "runs/compare.html", context)


def _uuid(value: str) -> str | None:
    try:
        return str(uuid.UUID(value))
    except ValueError:
        return None
