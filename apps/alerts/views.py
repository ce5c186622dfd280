"""``/t/<team>/alerts/``: the team's recent alerts (optionally of one run, ``?run=<id>``),
its rules, and the webhook delivery log. Rules are written through the API."""

from __future__ import annotations

import uuid

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from apps.alerts import selectors
from apps.teams.models import Membership, Team
from apps.teams.pages import page_context, team_page

PAGE_ROWS = 100


@team_page()
def alerts_page(request: HttpRequest, team: Team, membership: Membership) -> HttpResponse:
    run_id: uuid.UUID | None = None
    raw = request.GET.get("run", "")
    if raw:
        try:
            run_id = uuid.UUID(raw)
        except ValueError:
            run_id = None
    alerts = list(selectors.alerts_for(team.pk, run_id=run_id)
                  .order_by("-created_at")[:PAGE_ROWS]) if raw == "" or run_id else []
    deliveries = list(selectors.deliveries_for(team.pk).order_by("-created_at")[:PAGE_ROWS])
    return render(request, "alerts/alerts.html", page_context(
        request, team, membership, section="alerts", alerts=alerts, run_filter=raw[:64],
        rules=list(selectors.rules_for(team.pk)), deliveries=deliveries))
