"""What a locked-out login gets (django-axes' AXES_LOCKOUT_CALLABLE): 429 with Retry-After,
as the API's throttles answer, and a page that says how long to wait."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render


def lockout_response(request: HttpRequest, original_response: Any = None,
                     credentials: dict | None = None) -> HttpResponse:
    seconds = int(settings.AXES_COOLOFF_TIME.total_seconds())
    minutes = max(1, round(seconds / 60))
    message = (f"Too many failed logins for this account from this address; it is locked for "
               f"{minutes} minute{'s' if minutes != 1 else ''}. Wait, then try again.")
    if request.path.startswith("/api/"):
        response: HttpResponse = JsonResponse({"code": "locked_out", "message": message},
                                              status=429)
    else:
        response = render(request, "registration/locked_out.html", {"message": message},
                          status=429)
    response["Retry-After"] = str(seconds)
    return response
