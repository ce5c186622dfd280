"""Django's Redis cache with one client, and so one connection pool, per process.

Django keeps cache backends in context-local storage (``asgiref.local.Local``), and every
request the threaded ASGI handler serves runs in a fresh copy of the context
(``sync_to_async``): each request built a new ``RedisCache``, a new connection pool and a
new TCP connection to Redis, with its handshake, then dropped it for the garbage collector.
py-spy on a web process taking 1000-point metric batches found ~14% of its samples in
redis-py's connect and disconnect. redis-py's pool is thread-safe and resets itself in a
forked child, so one client per (servers, options) serves every thread of the process.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

from django.core.cache.backends.redis import RedisCache, RedisCacheClient
from django.utils.functional import cached_property


class SharedRedisCache(RedisCache):
    """``django.core.cache.backends.redis.RedisCache`` whose client outlives the request."""

    # RedisCache.__init__ assigns these; django-stubs does not declare them, so mypy is told here.
    _servers: list[str]
    _options: dict[str, Any]
    _class: type[RedisCacheClient]
    _clients: ClassVar[dict[tuple[tuple[str, ...], str], RedisCacheClient]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @cached_property
    def _cache(self) -> Any:
        key = (tuple(self._servers), repr(sorted(self._options.items())))
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                client = self._clients[key] = self._class(self._servers, **self._options)
        return client
