"""``/t/<team>/usage/``: the team's usage page: the API's document for the window in the
query string (the same reading of ``from``/``to``), as totals, a stacked chart of GPU-hours
per day by part, and tables per day and per run. Reads only: viewers see it."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from apps.core.exceptions import InvalidInput
from apps.teams.models import Membership, Team
from apps.teams.pages import page_context, team_page
from apps.usage.accounting import PARTS
from apps.usage.api import team_usage_document

LABELS = {"useful": "Useful", "startup": "Startup", "restart": "Restart",
          "lost_preemption": "Lost to preemption", "lost_failure": "Lost to failures",
          "held": "Held, no attempt running"}


def _chart(doc: dict[str, Any]) -> dict[str, Any]:
    """What static/js/usage.js draws: one bar per day, stacked by part, in GPU-hours (or
    core-hours when the team used no GPU in the window)."""
    unit = "gpu_hours" if doc["total"]["gpu_hours"]["allocated"] > 0 else "cpu_hours"
    return {"unit": "GPU-hours" if unit == "gpu_hours" else "core-hours",
            "days": [d["day"].isoformat() for d in doc["days"]],
            "parts": [{"key": p, "label": LABELS[p],
                       "values": [d[unit][p] for d in doc["days"]]} for p in PARTS]}


@team_page()
@require_GET
def usage_page(request: HttpRequest, team: Team, membership: Membership) -> HttpResponse:
    try:
        doc = team_usage_document(team, request.GET)
    except InvalidInput as exc:
        return render(request, "usage/usage.html", page_context(
            request, team, membership, section="usage", error=exc.message,
            values=request.GET))  # a form's error, shown as forms show theirs (200)
    return render(request, "usage/usage.html", page_context(
        request, team, membership, section="usage", doc=doc, chart=_chart(doc),
        labels=LABELS, values={"from": doc["from"].date().isoformat(),
                               "to": _last_day(doc["to"]).isoformat()}))


def _last_day(end: datetime) -> Any:
    """The date input's "to" for an exclusive end: the day before a midnight end."""
    return (end - timedelta(microseconds=1)).date()
