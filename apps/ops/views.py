"""``/readyz`` and ``/metrics``: plain Django views outside ``/api/v1/`` (probes and scrapers
are not API clients; neither view is in the OpenAPI schema)."""

from __future__ import annotations

import secrets

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from rest_framework.exceptions import AuthenticationFailed, Throttled

from apps.core import telemetry
from apps.core.throttles import client_ip
from apps.ops.collectors import BrokerCollector, DatabaseCollector
from apps.ops.readiness import run_checks
from apps.teams.authentication import verify_throttled
from apps.teams.models import TokenKind


@never_cache
@require_safe
def readyz(request: HttpRequest) -> JsonResponse:
    """200 when every check passes, else 503 with the first failing check's message; the
    body names each check with its latency either way."""
    results = run_checks()
    failed = [r for r in results if not r.ok]
    body: dict[str, object] = {
        "status": "not ready" if failed else "ready",
        "checks": {r.name: {"ok": r.ok, "latency_ms": r.latency_ms, "detail": r.detail}
                   for r in results},
    }
    if failed:
        body["code"] = "not_ready"
        body["message"] = f"{failed[0].name}: {failed[0].detail}"
    return JsonResponse(body, status=503 if failed else 200)


def _bearer(request: HttpRequest) -> str | None:
    scheme, _, raw = request.headers.get("Authorization", "").partition(" ")
    return raw.strip() if scheme.lower() == "bearer" and raw.strip() else None


def metrics_access(request: HttpRequest) -> int:
    """200 (may scrape), 401 (no or bad credentials) or 403 (signed in, not an operator).
    Allowed: ``CRUCIBLE_METRICS_TOKEN`` as a bearer token (what a Prometheus scrape config
    holds), an operator worker token (no team), a staff user's personal token or session."""
    raw = _bearer(request)
    if raw is not None:
        expected = settings.CRUCIBLE["METRICS_TOKEN"]
        if expected and secrets.compare_digest(raw.encode(), expected.encode()):
            return 200
        try:
            token = verify_throttled(raw, client_ip(request))
        except (AuthenticationFailed, Throttled):
            return 401
        if token.kind == TokenKind.WORKER:
            return 200 if token.team_id is None else 403
        return 200 if token.user is not None and token.user.is_staff else 403
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return 401
    return 200 if user.is_staff else 403


@never_cache
@require_safe
def metrics(request: HttpRequest) -> HttpResponse:
    """The Prometheus text exposition: this deployment's instruments and the gauges read from
    the database now (apps/ops/collectors.py)."""
    status = metrics_access(request)
    if status == 401:
        response = JsonResponse({"code": "not_authenticated", "message": (
            "Send a bearer token: CRUCIBLE_METRICS_TOKEN, an operator worker token or a staff "
            "user's token.")}, status=401)
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    if status == 403:
        return JsonResponse({"code": "permission_denied", "message": (
            "Only operators may read /metrics: staff users, operator worker tokens (not tied "
            "to a team) or CRUCIBLE_METRICS_TOKEN.")}, status=403)
    registry = telemetry.exposition_registry(DatabaseCollector(), BrokerCollector())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
