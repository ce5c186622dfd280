"""The Redis cache keeps one client per process (apps/core/cache.py): requests served by
the threaded ASGI handler, each its own task as uvicorn runs them, share it instead of each
building a client, a connection pool and a connection of its own."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from django.core.cache import caches

from apps.core.asgi_http import ThreadedHTTPHandler
from tests.apps.core import asgi_urls
from tests.apps.core.test_asgi_http import call

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.urls("tests.apps.core.asgi_urls")]

URL = "redis://127.0.0.1:6379/14"  # building a client does not connect


def clients_seen(requests: int = 4) -> list[object]:
    """The cache client each of ``requests`` requests saw, served one after another on one
    event loop, each request its own task (as uvicorn serves a connection's requests)."""
    app = ThreadedHTTPHandler(threads=2)
    asgi_urls.CACHE_CLIENTS.clear()

    async def serve() -> None:
        for _ in range(requests):
            status, _, _ = await asyncio.create_task(call(app, "GET", "/cache-client"))
            assert status == 200

    try:
        asyncio.run(serve())
    finally:
        app.close_connections()
        app.executor.shutdown()
    return list(asgi_urls.CACHE_CLIENTS)


@pytest.fixture
def cache_backend(settings: Any):
    def use(backend: str, **options: Any) -> None:
        settings.CACHES = {"default": {"BACKEND": backend, "LOCATION": URL,
                                       "KEY_PREFIX": "t", "OPTIONS": options}}
    return use


def test_requests_share_one_client(cache_backend):
    cache_backend("apps.core.cache.SharedRedisCache")
    seen = clients_seen()
    assert len(seen) == 4 and all(c is seen[0] for c in seen)


def test_django_backend_builds_a_client_per_request(cache_backend):
    """Why the subclass exists: Django's own backend, served the same way, builds a new
    client (a new pool, so a new connection) for every request."""
    cache_backend("django.core.cache.backends.redis.RedisCache")
    seen = clients_seen()
    assert len({id(c) for c in seen}) == 4


def test_other_servers_or_options_get_their_own_client(settings):
    settings.CACHES = {
        "default": {"BACKEND": "apps.core.cache.SharedRedisCache", "LOCATION": URL},
        "other": {"BACKEND": "apps.core.cache.SharedRedisCache", "LOCATION": URL,
                  "OPTIONS": {"db": 3}},
    }
    assert caches["default"]._cache is not caches["other"]._cache
