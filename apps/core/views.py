"""Small non-team views: health, the caller's identity, and the landing page."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.runs.models import Run
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
            "teams": [{"slug": t.slug, "name": t.name, "role": t.my_role} for t in teams],
        })


@login_required
def home(request: HttpRequest) -> HttpResponse:
    teams = list(teams_for_user(request.user).order_by("slug"))
    runs = (
        Run.objects.filter(team__in=teams).select_related("team", "project")
        .order_by("-created_at")[:50]
    )
    return render(request, "core/home.html", {"teams": teams, "runs": runs})
