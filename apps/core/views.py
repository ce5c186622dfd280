"""Small non-team views: health and the caller's identity."""

from __future__ import annotations

from django.db import connection
from django.http import HttpRequest, JsonResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.teams.authentication import WorkerPrincipal
from apps.teams.selectors import teams_for_user


def healthz(request: HttpRequest) -> JsonResponse:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return JsonResponse({"status": "ok", "database": connection.vendor})


class MeView(APIView):
    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        if isinstance(request.user, WorkerPrincipal):
            token = request.user.token
            return Response({"kind": "worker", "token": token.prefix,
                             "team": token.team.slug if token.team else None})
        teams = teams_for_user(request.user).order_by("slug")
        return Response({
            "kind": "user",
            "username": request.user.username,
            "teams": [{"slug": t.slug, "name": t.name, "role": getattr(t, "my_role", None)}
                      for t in teams],
        })
