"""Bearer-token authentication for DRF.

A personal token authenticates as its user. A worker token authenticates as a
:class:`WorkerPrincipal`, which team views refuse and worker views require.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from datetime import timedelta

from django.utils import timezone
from rest_framework import authentication, exceptions

from apps.core.actor import WorkerCaller
from apps.core.throttles import AuthFailureThrottle, client_ip
from apps.teams import token_cache, tokens
from apps.teams.models import ApiToken, TokenKind

# Write last_used_at at most this often per token: a worker posting metrics every
# second must not turn every request into an extra UPDATE.
LAST_USED_RESOLUTION = timedelta(minutes=1)


class TokenGuess(exceptions.AuthenticationFailed):
    """A token nobody issued (malformed, unknown, wrong secret): these count toward the
    per-address limit; a revoked or expired token proves its holder once had it."""


@dataclass(frozen=True)
class WorkerPrincipal(WorkerCaller):
    token: ApiToken

    is_authenticated = True
    is_active = True
    is_staff = False
    is_superuser = False
    is_anonymous = False

    @property
    def pk(self) -> None:
        return None

    @property
    def worker_token_prefix(self) -> str:
        return self.token.prefix

    @property
    def team_id(self) -> int | None:
        return self.token.team_id

    def __str__(self) -> str:
        return f"worker-token:{self.token.prefix}"


def verify_token(raw: str) -> ApiToken:
    """The live token for ``raw`` (last use recorded), or AuthenticationFailed saying why.
    Shared by the HTTP authentication below and the websocket middleware. A token this
    process verified before comes from ``token_cache`` while no token or user has changed
    anywhere since (one Redis read instead of a query); expiry is checked every time."""
    prefix = tokens.parse_prefix(raw)
    if prefix is None:
        raise TokenGuess("Malformed token: expected crc_… or crw_….")
    digest = tokens.hash_token(raw)
    current = token_cache.generation()  # read before the query: see token_cache.store
    token = token_cache.lookup(prefix, digest, current)
    if token is None:
        token = ApiToken.objects.select_related("user").filter(prefix=prefix).first()
        if token is None or not hmac.compare_digest(digest, token.key_hash):
            raise TokenGuess("Invalid token.")
        if token.revoked_at is not None:
            raise exceptions.AuthenticationFailed("Token has been revoked.")
        _check_expiry(token)  # before the user, as always (checked again below when cached)
        # A personal token always has a user (the token_kind_owner constraint).
        if token.kind == TokenKind.PERSONAL and (token.user is None or
                                                 not token.user.is_active):
            raise exceptions.AuthenticationFailed("User is inactive.")
        token_cache.store(prefix, digest, token, current)
    _check_expiry(token)
    now = timezone.now()
    if token.last_used_at is None or now - token.last_used_at > LAST_USED_RESOLUTION:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
        token.last_used_at = now
        token_cache.touch(prefix, now)
    return token


def _check_expiry(token: ApiToken) -> None:
    if token.expires_at is not None and token.expires_at <= timezone.now():
        raise exceptions.AuthenticationFailed("Token has expired; create a new one.")


def verify_throttled(raw: str, ip: str) -> ApiToken:
    """:func:`verify_token` behind the per-address limit on guesses (429 past it)."""
    failures = AuthFailureThrottle(ip)
    failures.check()
    try:
        return verify_token(raw)
    except TokenGuess:
        failures.record_failure()
        raise


class BearerTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        scheme, _, raw = header.partition(" ")
        if scheme.lower() != self.keyword.lower():
            return None
        token = verify_throttled(raw.strip(), client_ip(request))
        if token.kind == TokenKind.WORKER:
            return WorkerPrincipal(token), token
        return token.user, token

    def authenticate_header(self, request) -> str:
        return self.keyword
