"""Dashboard pages (server-rendered, htmx for partial swaps, a websocket for live data)."""

from __future__ import annotations

import json

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from apps.core.access import access_team
from apps.core.exceptions import NotFound
from apps.projects.models import Project
from apps.runs.models import Run
from apps.runs.selectors import runs_with_relations
from apps.teams.selectors import teams_for_user

EVENT_TAIL = 200


def _team(request: HttpRequest, slug: str):  # noqa: ANN202
    try:
        return access_team(request.user, slug)
    except NotFound as exc:
        raise Http404(exc.message) from exc


def _context(request: HttpRequest, team, membership, **extra):  # noqa: ANN001, ANN202
    return {"team": team, "membership": membership,
            "teams": teams_for_user(request.user).order_by("slug"), **extra}


@login_required
def home(request: HttpRequest) -> HttpResponse:
    first = teams_for_user(request.user).order_by("slug").first()
    if first is not None:
        return redirect("team-runs", team=first.slug)
    return render(request, "runs/no_team.html", {"teams": []})


@login_required
def team_runs(request: HttpRequest, team: str) -> HttpResponse:
    team_obj, membership = _team(request, team)
    runs = runs_with_relations(Run.objects.filter(team=team_obj)).order_by("-created_at")
    project = request.GET.get("project") or ""
    if project:
        runs = runs.filter(project__slug=project)
    status = request.GET.get("status") or ""
    if status:
        runs = runs.filter(status=status)
    context = _context(request, team_obj, membership, section="runs", runs=runs[:200],
                       project=project,
                       status=status,
                       projects=Project.objects.filter(team=team_obj).order_by("slug"))
    template = "runs/_runs_table.html" if request.htmx else "runs/team_runs.html"
    return render(request, template, context)


@login_required
def team_projects(request: HttpRequest, team: str) -> HttpResponse:
    team_obj, membership = _team(request, team)
    projects = Project.objects.filter(team=team_obj).order_by("slug")
    counts = {}
    for slug in projects.values_list("slug", flat=True):
        counts[slug] = Run.objects.filter(team=team_obj, project__slug=slug).count()
    rows = [(p, counts[p.slug]) for p in projects]
    return render(request, "runs/team_projects.html",
                  _context(request, team_obj, membership, section="projects", rows=rows))


@login_required
def run_detail(request: HttpRequest, team: str, run: str) -> HttpResponse:
    team_obj, membership = _team(request, team)
    obj = runs_with_relations(Run.objects.filter(team=team_obj)).filter(pk=_uuid(run)).first()
    if obj is None:
        raise Http404("No such run.")
    events = list(obj.events.order_by("-seq")[:EVENT_TAIL])[::-1]
    context = _context(
        request, team_obj, membership, section="runs", run=obj, events=events,
        stream_seq=obj.event_seq, config_json=json.dumps(obj.config, indent=2, sort_keys=True),
    )
    return render(request, "runs/run_detail.html", context)


def _uuid(value: str) -> str | None:
    import uuid

    try:
        return str(uuid.UUID(value))
    except ValueError:
        return None
