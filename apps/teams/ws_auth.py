"""Websocket authentication: a bearer token (scripts, other services) or the browser
session. Session connections must come from an allowed origin (cross-site websocket
hijacking); token connections carry their own credential, so no origin is required."""

from __future__ import annotations

from typing import Any

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.security.websocket import AllowedHostsOriginValidator
from django.contrib.auth.models import AnonymousUser
from rest_framework.exceptions import AuthenticationFailed, Throttled

from apps.teams.authentication import verify_throttled
from apps.teams.models import TokenKind


@database_sync_to_async
def _user_for_token(raw: str, ip: str) -> Any:
    """Personal tokens only: worker tokens have no business on the live streams. Guesses
    count toward the same per-address limit as the HTTP API's."""
    try:
        token = verify_throttled(raw, ip)
    except (AuthenticationFailed, Throttled):
        return AnonymousUser()
    return token.user if token.kind == TokenKind.PERSONAL else AnonymousUser()


class TokenOrSessionAuth:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.session_app = AllowedHostsOriginValidator(AuthMiddlewareStack(inner))

    async def __call__(self, scope: dict, receive: Any, send: Any) -> Any:
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, raw = auth.partition(" ")
        if scheme.lower() == "bearer" and raw.strip():
            client = scope.get("client") or ("", 0)
            scope = {**scope, "user": await _user_for_token(raw.strip(), str(client[0]))}
            return await self.inner(scope, receive, send)
        return await self.session_app(scope, receive, send)
