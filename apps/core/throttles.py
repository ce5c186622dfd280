"""API rate limits (DRF throttles) and the client address they key on.

- ``user``: per personal token, or per user for a browser session;
- ``worker``: per worker token (a pool posts metrics, events and heartbeats often);
- ``anon``: per client IP, for requests that authenticate as nobody;
- ``auth_failure``: per client IP, wrong or malformed bearer tokens; past the limit every
  bearer attempt from that address is refused for the rest of the window, right or wrong, so
  secrets cannot be guessed at speed.

Each answers 429 with ``Retry-After``. Rates live in ``settings.CRUCIBLE["THROTTLE_RATES"]``
(``CRUCIBLE_THROTTLE_*``), read on every request so a settings change applies at once. The
counters live in the default cache: Redis in production, so every web process shares them.
Password logins are django-axes' business (see ``config/settings.py``).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest
from rest_framework.exceptions import Throttled
from rest_framework.throttling import SimpleRateThrottle

from apps.core.actor import WorkerCaller


def client_ip(request: HttpRequest) -> str:
    """The caller's address: ``REMOTE_ADDR``, or, behind ``CRUCIBLE_TRUSTED_PROXIES`` proxies
    that each append to ``X-Forwarded-For``, the entry the outermost trusted proxy added.
    A client-supplied header is never trusted on its own."""
    remote = request.META.get("REMOTE_ADDR") or ""
    proxies = int(settings.CRUCIBLE.get("TRUSTED_PROXIES", 0))
    forwarded = request.META.get("HTTP_X_FORWARDED_FOR")
    if proxies <= 0 or not forwarded:
        return remote
    hops = [h.strip() for h in forwarded.split(",") if h.strip()]
    return hops[-min(proxies, len(hops))] if hops else remote


def axes_client_ip(request: HttpRequest) -> str:
    """django-axes' AXES_CLIENT_IP_CALLABLE: the same address the API throttles use."""
    return client_ip(request)


class _RateFromSettings(SimpleRateThrottle):
    def get_rate(self) -> str | None:
        return settings.CRUCIBLE["THROTTLE_RATES"].get(self.scope)

    def get_ident(self, request: Any) -> str:
        return client_ip(request)


def _principal(request: Any) -> tuple[str, str] | None:
    """("worker"|"user", key) for an authenticated request, None for an anonymous one."""
    user = request.user
    if isinstance(user, WorkerCaller):
        return "worker", f"wtok:{user.worker_token_prefix}"
    if getattr(user, "is_authenticated", False):
        token = getattr(request, "auth", None)
        prefix = getattr(token, "prefix", None)
        return "user", f"tok:{prefix}" if prefix else f"user:{user.pk}"
    return None


class TokenRateThrottle(_RateFromSettings):
    """Personal tokens and sessions (scope ``user``)."""

    scope = "user"

    def get_cache_key(self, request: Any, view: Any) -> str | None:
        who = _principal(request)
        if who is None or who[0] != "user":
            return None
        return self.cache_format % {"scope": self.scope, "ident": who[1]}


class WorkerRateThrottle(_RateFromSettings):
    """Worker tokens (scope ``worker``)."""

    scope = "worker"

    def get_cache_key(self, request: Any, view: Any) -> str | None:
        who = _principal(request)
        if who is None or who[0] != "worker":
            return None
        return self.cache_format % {"scope": self.scope, "ident": who[1]}


class AnonIPRateThrottle(_RateFromSettings):
    """Unauthenticated requests, by client IP (scope ``anon``)."""

    scope = "anon"

    def get_cache_key(self, request: Any, view: Any) -> str | None:
        if _principal(request) is not None:
            return None
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}


class AuthFailureThrottle(_RateFromSettings):
    """Failed bearer-token authentications by client IP: checked before a token is looked
    up, counted after it fails (see ``apps.teams.authentication``)."""

    scope = "auth_failure"

    def __init__(self, ip: str) -> None:
        super().__init__()
        self.key = self.cache_format % {"scope": self.scope, "ident": ip or "unknown"}

    def _load(self) -> None:
        self.history = self.cache.get(self.key, [])
        self.now = self.timer()
        while self.history and self.history[-1] <= self.now - self.duration:
            self.history.pop()

    def check(self) -> None:
        """Raise Throttled (429 + Retry-After) while this address is over its limit."""
        if self.rate is None:
            return
        self._load()
        if len(self.history) >= self.num_requests:
            raise Throttled(wait=self.wait(), detail=(
                "Too many failed token authentications from this address; "
                f"try again in {int(self.wait() or 1)} seconds."))

    def record_failure(self) -> None:
        if self.rate is None:
            return
        self._load()
        self.history.insert(0, self.now)
        self.cache.set(self.key, self.history, self.duration)
