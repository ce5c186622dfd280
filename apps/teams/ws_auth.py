"""Websocket authentication: a bearer token (scripts, other services) or the browser
session. Session connections must come from an allowed origin (cross-site websocket
hijacking); token connections carry their own credential, so no origin is required."""

from __future__ import annotations

from typing import Any

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.security.websocket import AllowedHostsOriginValidator
from django.contrib.auth.models import AnonymousUser
from django.utils import timezone

from apps.teams import tokens
from apps.teams.models import ApiToken, TokenKind


@database_sync_to_async
def _user_for_token(raw: str) -> Any:
    prefix = tokens.parse_prefix(raw)
    if prefix is None:
        return AnonymousUser()
    token = ApiToken.objects.select_related("user").filter(
        prefix=prefix, kind=TokenKind.PERSONAL).first()
    if token is None or not tokens.matches(raw, token.key_hash) or not token.is_active:
        return AnonymousUser()
    if not token.user.is_active:
        return AnonymousUser()
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now())
    return token.user


class TokenOrSessionAuth:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.session_app = AllowedHostsOriginValidator(AuthMiddlewareStack(inner))

    async def __call__(self, scope: dict, receive: Any, send: Any) -> Any:
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, raw = auth.partition(" ")
        if scheme.lower() == "bearer" and raw.strip():
            scope = {**scope, "user": await _user_for_token(raw.strip())}
            return await self.inner(scope, receive, send)
        return await self.session_app(scope, receive, send)
