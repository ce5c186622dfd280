"""Dashboard pages (server-rendered, htmx for partial swaps, a websocket for live data).

Pages read through ``apps.runs.dashboard`` and write through the same services the API
uses, so a page never accepts what the API would refuse."""

from __future__ import annotations

import json
import uuid
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from apps.core.actor import Actor
from apps.core.exceptions import DomainError
from apps.core.pages import page_context, team_for_page
from apps.projects.models import Project
from apps.runs import dashboard, selectors, services
from apps.runs.forms import PRESETS, LaunchForm, initial_from_preset, initial_from_run
from apps.runs.models import EventLevel, Run, RunKind, RunStatus
from apps.runs.selectors import runs_with_relations
from apps.teams.models import Role, role_at_least
from apps.teams.selectors import teams_for_user

EVENT_TAIL = 200


def _run(team_obj, run: str) -> Run:  # noqa: ANN001
    obj = runs_with_relations(Run.objects.filter(team=team_obj)).select_related(
        "created_by").filter(pk=_uuid(run)).first()
    if obj is None:
        raise Http404("No such run.")
    return obj


@login_required
def home(request: HttpRequest) -> HttpResponse:
    first = teams_for_user(request.user).order_by("slug").first()
    if first is not None:
        return redirect("team-runs", team=first.slug)
    return render(request, "runs/no_team.html", {"teams": []})


def runs_table_context(team_obj, membership, request: HttpRequest) -> dict[str, Any]:  # noqa: ANN001
    filters = dashboard.RunFilters.from_query(request.GET)
    page = dashboard.runs_page(team_obj, filters)
    return {
        "filters": filters, "page": page, "runs": list(page.object_list),
        "sort_key": filters.sort.lstrip("-"), "sort_desc": filters.sort.startswith("-"),
        "columns": [("name", "Run"), ("kind", "Kind"), ("status", "Status"),
                    ("priority", "Priority"), ("created", "Created"), ("updated", "Updated")],
    }


@login_required
def team_runs(request: HttpRequest, team: str) -> HttpResponse:
    team_obj, membership = team_for_page(request, team)
    table = runs_table_context(team_obj, membership, request)
    if request.htmx and request.htmx.target == "runs":
        return render(request, "runs/_runs_table.html",
                      page_context(request, team_obj, membership, **table))
    context = page_context(
        request, team_obj, membership, section="runs", **table,
        choices=dashboard.filter_choices(team_obj), kinds=RunKind.values,
        statuses=RunStatus.values, max_compare=dashboard.MAX_COMPARE,
    )
    return render(request, "runs/team_runs.html", context)


@login_required
def team_projects(request: HttpRequest, team: str) -> HttpResponse:
    from django.db.models import Count

    team_obj, membership = team_for_page(request, team)
    projects = Project.objects.filter(team=team_obj).annotate(n_runs=Count("runs")).order_by(
        "slug")
    rows = [(p, p.n_runs) for p in projects]
    return render(request, "runs/team_projects.html",
                  page_context(request, team_obj, membership, section="projects", rows=rows))


# --- launch --------------------------------------------------------------------------------


@login_required
def run_launch(request: HttpRequest, team: str) -> HttpResponse:
    team_obj, membership = team_for_page(request, team)
    if request.method == "POST" and not role_at_least(membership.role, Role.MEMBER):
        raise PermissionDenied("Viewers cannot launch runs; ask a team admin for the member role.")
    preview = None
    if request.method == "POST":
        form = LaunchForm(request.POST, team=team_obj)
        plan = form.plan()
        if plan is not None and request.POST.get("action") == "launch":
            run = services.create_run(actor=Actor.of_user(request.user),
                                      team_id=team_obj.pk, plan=plan)
            messages.success(request, "Run queued. It starts when a worker of its pool is free.")
            return redirect("run-page", team=team_obj.slug, run=str(run.pk))
        if plan is not None:
            preview = json.dumps(plan.describe(), indent=2, sort_keys=True)
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
        form = LaunchForm(initial=initial, team=team_obj)
        if "project" not in initial and form.fields["project"].choices:
            form.initial["project"] = form.fields["project"].choices[0][0]
    context = page_context(request, team_obj, membership, section="launch", form=form,
                       preview=preview, presets=PRESETS,
                       clone=request.GET.get("clone") or request.POST.get("clone") or "")
    status = 400 if request.method == "POST" and form.errors else 200
    return render(request, "runs/launch.html", context, status=status)


# --- run page --------------------------------------------------------------------------------


@login_required
def run_detail(request: HttpRequest, team: str, run: str) -> HttpResponse:
    team_obj, membership = team_for_page(request, team)
    obj = _run(team_obj, run)
    if request.method == "POST":
        return _run_action(request, team_obj, membership, obj)
    events = list(obj.events.order_by("-seq")[:EVENT_TAIL])[::-1]
    steps = dashboard.sample_steps(obj)
    context = page_context(
        request, team_obj, membership, section="runs", run=obj, events=events,
        stream_seq=obj.event_seq, config_json=json.dumps(obj.config, indent=2, sort_keys=True),
        checkpoints=list(obj.checkpoints.order_by("step")),
        neighbours=dashboard.lineage_neighbours(obj), levels=EventLevel.values,
        **_samples_context(obj, steps, request),
        can_cancel=obj.status in services.TRANSITIONS and RunStatus.CANCELED in
        services.TRANSITIONS[obj.status],
        can_resume=obj.status in (RunStatus.FAILED, RunStatus.CANCELED),
    )
    return render(request, "runs/run_detail.html", context)


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
    components = sorted({k for s in samples for k in (s.reward_components or {})})
    rl_samples = any(s.advantage is not None or s.weight_version is not None for s in samples)
    return {"sample_steps": steps, "sample_step": step, "sample_sort": sort,
            "samples": samples, "components": components, "rl_samples": rl_samples}


@login_required
def run_samples(request: HttpRequest, team: str, run: str) -> HttpResponse:
    team_obj, membership = team_for_page(request, team)
    obj = _run(team_obj, run)
    context = page_context(request, team_obj, membership, run=obj,
                       **_samples_context(obj, dashboard.sample_steps(obj), request))
    return render(request, "runs/_samples.html", context)


def _run_action(request: HttpRequest, team_obj, membership, obj: Run) -> HttpResponse:  # noqa: ANN001
    """Cancel or resume from the run page (a POST to the page, ``op`` names the action)."""
    if not role_at_least(membership.role, Role.MEMBER):
        raise PermissionDenied("Viewers cannot change runs.")
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


@login_required
def run_compare(request: HttpRequest, team: str) -> HttpResponse:
    team_obj, membership = team_for_page(request, team)
    ids = dashboard.parse_run_ids(request.GET.getlist("run"))
    too_many = len(ids) > dashboard.MAX_COMPARE
    ids = ids[: dashboard.MAX_COMPARE]
    found = {str(r.pk): r for r in runs_with_relations(Run.objects.filter(team=team_obj,
                                                                          pk__in=ids))}
    runs = [found[i] for i in ids if i in found]
    config_rows = dashboard.config_table([r.config for r in runs])
    reports = [selectors.report_or_none(r) for r in runs]
    context = page_context(
        request, team_obj, membership, section="runs", runs=runs, too_many=too_many,
        config_rows=config_rows, n_differ=sum(r.differs for r in config_rows),
        report_rows=dashboard.report_table(reports) if any(reports) else [],
        has_reports=[r is not None for r in reports], max_compare=dashboard.MAX_COMPARE,
        missing=dashboard.MISSING, show_all=request.GET.get("all") == "1",
        runs_meta=[{"id": str(r.pk), "label": r.name or str(r.pk)[:8]} for r in runs],
    )
    return render(request, "runs/compare.html", context)


def _uuid(value: str) -> str | None:
    try:
        return str(uuid.UUID(value))
    except ValueError:
        return None
