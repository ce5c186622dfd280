"""The API's default permission: authenticated, and anonymous callers rate-limited by
address before they are told so (DRF checks permissions before throttles, so without this
an anonymous caller would never reach a throttle)."""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import Throttled
from rest_framework.permissions import IsAuthenticated

from apps.core.throttles import AnonIPRateThrottle


class AuthenticatedOrThrottled(IsAuthenticated):
    def has_permission(self, request: Any, view: Any) -> bool:
        if super().has_permission(request, view):
            return True
        throttle = AnonIPRateThrottle()
        if not throttle.allow_request(request, view):
            raise Throttled(wait=throttle.wait())
        return False
