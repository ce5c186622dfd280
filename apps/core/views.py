"""Small non-team views: health. (The caller's identity, ``/api/v1/me``, lists their teams,
so it lives in ``apps.teams.api``.)"""

from __future__ import annotations

from django.db import connection
from django.http import HttpRequest, JsonResponse


def healthz(request: HttpRequest) -> JsonResponse:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return JsonResponse({"status": "ok", "database": connection.vendor})
