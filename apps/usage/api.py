"""``GET /api/v1/teams/<team>/usage?from=&to=&group=day``: what the team's runs held in a
window (GPU- and CPU-hours allocated, useful, lost to preemption and failures, restarts,
idle), per UTC day and per run, priced at the configured rates; ``GET …/usage/runs/<id>``:
one run over its whole life. Reads only: viewers may call both."""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core.schema import OneDocumentSchema
from apps.runs.models import Run
from apps.teams.viewsets import TeamScopedViewSet
from apps.usage import selectors
from apps.usage.serializers import RunUsageSerializer, TeamUsageSerializer

WINDOW = [
    OpenApiParameter("from", OpenApiTypes.STR, description="a date (UTC midnight) or ISO 8601 "
                     "time; default: 6 days before the day of 'to'"),
    OpenApiParameter("to", OpenApiTypes.STR, description="a date (the end of that UTC day) or "
                     "ISO 8601 time; default: now"),
    OpenApiParameter("group", OpenApiTypes.STR, enum=list(selectors.GROUPS)),
]


def team_usage_document(team: Any, params: Any) -> dict[str, Any]:
    """The API's answer, which the page renders too (one reading of the query string)."""
    start, end, group = selectors.window(params)
    found = selectors.team_usage(team, start, end)
    hourly = selectors.rates()
    return {
        "from": start, "to": end, "group": group, "currency": selectors.currency(),
        "rates": hourly, "total": selectors.usage_dict(found.total, hourly),
        "days": [{"day": day, **selectors.usage_dict(u, hourly)} for day, u in found.days],
        "runs": [selectors.run_row(r, hourly) for r in found.runs],
    }


class UsageViewSet(TeamScopedViewSet):
    queryset = Run.objects.all()  # what the team's usage is read from
    pagination_class = None
    filter_backends: list[Any] = []
    schema = OneDocumentSchema()  # `list` answers one document (the API fuzz caught "array")

    @extend_schema(parameters=WINDOW, responses=TeamUsageSerializer)
    def list(self, request: Request, team: str) -> Response:
        return Response(team_usage_document(self.team, request.query_params))

    @extend_schema(responses=RunUsageSerializer)
    @action(detail=False, methods=["get"], url_path=r"runs/(?P<run>[^/]+)")
    def run(self, request: Request, team: str, run: str) -> Response:
        """One run's usage from its first admission or claim until now (or its end)."""
        found = selectors.run_usage(self.team, run)
        return Response(selectors.run_row(found, selectors.rates()))
