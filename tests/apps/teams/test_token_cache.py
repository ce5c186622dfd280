"""Verified tokens cached per web process (apps/teams/token_cache.py): the cache is used,
and a revocation, a deactivated user or a deleted token takes effect on the next request
in every process — including one that still holds the token in its memory."""

from __future__ import annotations

import os
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from apps.core.actor import Actor
from apps.teams import token_cache
from apps.teams.models import ApiToken
from apps.teams.services import token_revoke
from tests.skips import host_skip


@pytest.fixture
def shared_cache(settings: Any) -> None:
    """The cache on Redis, as in production (the cache stays off without a shared one)."""
    url = os.environ.get("REDIS_URL", "").strip()
    if not url:
        host_skip("the token cache needs a shared cache: Redis (REDIS_URL), PostgreSQL pass")
    settings.CACHES = {"default": {**settings.CACHES["default"],
                                   "BACKEND": "apps.core.cache.SharedRedisCache",
                                   "LOCATION": url}}
    settings.CRUCIBLE = {**settings.CRUCIBLE, "TOKEN_CACHE_S": 30}
    token_cache._entries.clear()


def token_queries(caller: Any) -> int:
    with CaptureQueriesContext(connection) as queries:
        assert caller.client.get("/api/v1/me").status_code == 200
    return sum('"teams_apitoken"."key_hash"' in q["sql"] for q in queries.captured_queries)


def as_other_process(commit_change: Any) -> None:
    """Run ``commit_change`` as another web process would: this process's entries survive
    it (only the generation in Redis moves), as they would in a process that did not make
    the change. (A test runs in one transaction, so the on-commit bump is run by hand.)"""
    kept = dict(token_cache._entries)
    commit_change()
    token_cache.bump()
    token_cache._entries.update(kept)


def test_a_verified_token_is_not_queried_again(shared_cache, make_caller):
    caller = make_caller(None, username="cached")
    assert token_queries(caller) == 1
    assert token_queries(caller) == 0


def test_a_revocation_elsewhere_applies_on_the_next_request(shared_cache, make_caller):
    caller = make_caller(None, username="revoked")
    assert token_queries(caller) == 1 and token_queries(caller) == 0
    token = ApiToken.objects.get(prefix=caller.token.split("_")[1])
    as_other_process(lambda: token_revoke(actor=Actor.system(), token=token))
    assert token_cache._entries  # the stale entry is still there ...
    response = caller.client.get("/api/v1/me")
    assert response.status_code == 401  # ... and not used
    assert response.json()["message"] == "Token has been revoked."


def test_a_user_deactivated_elsewhere_is_refused_on_the_next_request(shared_cache, make_caller):
    caller = make_caller(None, username="deact")
    assert caller.client.get("/api/v1/me").status_code == 200

    def deactivate() -> None:
        caller.user.is_active = False
        caller.user.save(update_fields=["is_active"])

    as_other_process(deactivate)
    assert caller.client.get("/api/v1/me").status_code == 401


def test_a_deleted_token_is_refused_on_the_next_request(shared_cache, make_caller):
    caller = make_caller(None, username="gone")
    assert caller.client.get("/api/v1/me").status_code == 200
    as_other_process(lambda: ApiToken.objects.filter(
        prefix=caller.token.split("_")[1]).get().delete())
    assert caller.client.get("/api/v1/me").status_code == 401


def test_a_change_without_signals_applies_after_the_age_limit(shared_cache, make_caller):
    """A raw UPDATE bumps nothing: the entry's age limit bounds how long it is used."""
    from django.utils import timezone

    caller = make_caller(None, username="raw")
    assert caller.client.get("/api/v1/me").status_code == 200
    prefix = caller.token.split("_")[1]
    ApiToken.objects.filter(prefix=prefix).update(revoked_at=timezone.now())
    assert caller.client.get("/api/v1/me").status_code == 200  # within TOKEN_CACHE_S
    entry = token_cache._entries[prefix]
    token_cache._entries[prefix] = entry._replace(loaded=entry.loaded - 31)
    assert caller.client.get("/api/v1/me").status_code == 401


def test_another_secret_with_a_cached_prefix_is_still_a_guess(shared_cache, make_caller):
    caller = make_caller(None, username="guess")
    assert caller.client.get("/api/v1/me").status_code == 200
    head, _, tail = caller.token.rpartition("_")
    from tests.django_fixtures import client_for_token

    response = client_for_token(f"{head}_{'A' * len(tail)}").get("/api/v1/me")
    assert response.status_code == 401 and response.json()["message"] == "Invalid token."


def test_an_expired_cached_token_is_refused(shared_cache, make_caller):
    from datetime import timedelta

    from django.utils import timezone

    caller = make_caller(None, username="exp")
    assert caller.client.get("/api/v1/me").status_code == 200
    prefix = caller.token.split("_")[1]
    token_cache._entries[prefix].token.expires_at = timezone.now() - timedelta(seconds=1)
    response = caller.client.get("/api/v1/me")
    assert response.status_code == 401 and "expired" in response.json()["message"]


def test_without_a_shared_cache_nothing_is_cached(settings, make_caller):
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    caller = make_caller(None, username="local")
    assert token_queries(caller) == 1 and token_queries(caller) == 1
