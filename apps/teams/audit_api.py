"""``GET /api/v1/teams/<team>/audit-log``: the team's audit trail, for its admins.

Every write made through a service leaves a row (who, what, on which object, when, and
what changed); this is where a team admin reads them without Django admin. Filters:
``actor``, ``action`` (``run.`` for a prefix), ``object`` (``<type>:<id>``) or
``target_type``/``target_id``, ``since``/``until`` (ISO 8601); cursor pages, newest first.
"""

from __future__ import annotations

from datetime import datetime
from typing import ClassVar

from django.utils.dateparse import parse_datetime
from django.utils.timezone import is_naive, make_aware
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core import selectors
from apps.core.exceptions import InvalidInput
from apps.core.models import AuditLog
from apps.core.pagination import CursorPagination
from apps.teams.models import Role
from apps.teams.viewsets import TeamScopedViewSet


class AuditLogSerializer(serializers.ModelSerializer):
    actor = serializers.CharField(source="actor_label", read_only=True,
                                  help_text="username, worker:<token prefix>[/<worker>] or system")
    actor_username = serializers.SerializerMethodField()

    class Meta:
        model = AuditLog
        fields = ["id", "created_at", "actor", "actor_username", "action", "target_type",
                  "target_id", "data"]
        read_only_fields = fields

    def get_actor_username(self, row: AuditLog) -> str | None:
        return row.actor.username if row.actor else None


class AuditCursor(CursorPagination):
    ordering = "-id"
    max_page_size = 500


def parse_time(raw: str | None, name: str) -> datetime | None:
    if not raw:
        return None
    try:
        value = parse_datetime(raw)
    except ValueError:
        value = None
    if value is None:
        raise InvalidInput(f"{name} must be an ISO 8601 date-time, e.g. 2026-12-01T00:00:00Z.",
                           details={name: [raw[:60]]})
    return make_aware(value) if is_naive(value) else value


FILTERS = [
    OpenApiParameter("actor", OpenApiTypes.STR,
                     description="username, or an actor label such as worker:<prefix>"),
    OpenApiParameter("action", OpenApiTypes.STR,
                     description="e.g. run.create; ending in '.' or '*' matches a prefix"),
    OpenApiParameter("object", OpenApiTypes.STR, description="<target_type>:<target_id>"),
    OpenApiParameter("target_type", OpenApiTypes.STR),
    OpenApiParameter("target_id", OpenApiTypes.STR),
    OpenApiParameter("since", OpenApiTypes.DATETIME, description="inclusive"),
    OpenApiParameter("until", OpenApiTypes.DATETIME, description="exclusive"),
]


def filters_from(params: dict) -> dict:
    """The selector's keyword arguments from a query string (API and page alike)."""
    target_type, target_id = params.get("target_type", ""), params.get("target_id", "")
    obj = params.get("object", "")
    if obj:
        target_type, sep, target_id = obj.partition(":")
        if not sep or not target_type or not target_id:
            raise InvalidInput("object must be <target_type>:<target_id>, e.g. run:<id>.",
                               details={"object": [obj[:100]]})
    return {"actor": params.get("actor", "")[:200], "action": params.get("action", "")[:100],
            "target_type": target_type[:50], "target_id": target_id[:100],
            "since": parse_time(params.get("since"), "since"),
            "until": parse_time(params.get("until"), "until")}


class AuditLogViewSet(TeamScopedViewSet):
    method_roles: ClassVar[dict[str, str]] = {m: Role.ADMIN for m in ("GET", "HEAD", "OPTIONS")}
    queryset = AuditLog.objects.all()
    serializer_class = AuditLogSerializer
    pagination_class = AuditCursor
    filter_backends: ClassVar[list] = []
    ordering = "-id"

    @extend_schema(parameters=FILTERS, responses=AuditLogSerializer(many=True))
    def list(self, request: Request, team: str) -> Response:
        rows = selectors.audit_log(team_id=self.team.pk, **filters_from(request.query_params))
        page = self.paginate_queryset(rows)
        return self.get_paginated_response(AuditLogSerializer(page, many=True).data)
