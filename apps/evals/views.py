"""``/t/<team>/evals/``: the team's eval suites; ``/t/<team>/evals/<suite>/``: a suite's
leaderboard (capability, cost, latency, Pareto front) and its latest evaluations with their
verdicts. Reads only; the same figures as the API's."""

from __future__ import annotations

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_safe

from apps.core.exceptions import NotFound
from apps.evals import selectors
from apps.teams.models import Membership, Team
from apps.teams.pages import page_context, team_page

VERDICT_CLASS = {"passed": "status-succeeded", "regressed": "status-failed",
                 "failed": "status-canceled", "pending": "status-running"}


@team_page()
@require_safe
def suite_list(request: HttpRequest, team: Team, membership: Membership) -> HttpResponse:
    return render(request, "evals/suites.html", page_context(
        request, team, membership, section="evals", suites=list(selectors.suites(team))))


@team_page()
@require_safe
def leaderboard(request: HttpRequest, team: Team, membership: Membership,
                suite: str) -> HttpResponse:
    try:
        obj = selectors.access_suite(team, suite)
    except NotFound as exc:
        raise Http404(exc.message) from exc
    order = request.GET.get("order", "capability")
    if order not in selectors.ORDERS:
        order = "capability"
    evaluations = selectors.evaluation_reports(selectors.suite_evaluations(obj, 20))
    for e in evaluations:
        e["verdict_class"] = VERDICT_CLASS[e["verdict"]]
    return render(request, "evals/leaderboard.html", page_context(
        request, team, membership, section="evals", suite=obj, order=order,
        orders=selectors.ORDERS, board=selectors.leaderboard(obj, order),
        entries=list(obj.entries.select_related("environment_version__environment")),
        evaluations=evaluations))
