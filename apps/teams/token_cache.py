"""A per-process cache of verified API tokens, invalidated across web processes.

Every API request verified its bearer token with a database query (the token and its user),
the third-largest wait of a metric batch after COMMIT and the ingest statement. Here a
process keeps the tokens it verified, each with the *generation* it was read at: one integer
in the shared cache (Redis), incremented after every commit that saves or deletes any token
or user (``post_save``/``post_delete``, see :func:`connect`). A request reads the generation
(one Redis GET, no SQL) and uses its cached token only if nothing changed since, so a
revocation, a user deactivated or a token deleted takes effect on the next request in every
process, as before. A change that bypasses model signals (a raw ``UPDATE``) is covered by
the entry's age limit, ``CRUCIBLE_TOKEN_CACHE_S`` (30 s by default).

Only with a cache every web process shares (``REDIS_URL``): with the in-process default
cache a generation bump would not reach other processes, so nothing is cached there. A
cache that cannot be read disables the shortcut for that request (the database decides).
Expiry is time-based and checked on every request, cached or not.
"""

from __future__ import annotations

import copy
import hmac
import logging
import threading
import time
from typing import Any, NamedTuple

from django.conf import settings
from django.core.cache import cache
from django.db import transaction

log = logging.getLogger(__name__)

GENERATION_KEY = "auth:token-generation"
MAX_ENTRIES = 10_000  # a process forgets all at this size (tokens are few; guesses are not cached)


class _Entry(NamedTuple):
    digest: str  # SHA-256 of the whole raw token that was verified
    token: Any  # the ApiToken, user loaded
    generation: int
    loaded: float  # time.monotonic()


_entries: dict[str, _Entry] = {}
_lock = threading.Lock()


def enabled() -> bool:
    return settings.CRUCIBLE.get("TOKEN_CACHE_S", 0) > 0 and \
        "redis" in settings.CACHES["default"]["BACKEND"].lower()


def generation() -> int | None:
    """The shared generation, or None when the cache is off or unreadable."""
    if not enabled():
        return None
    try:
        return int(cache.get(GENERATION_KEY, 0))
    except Exception:  # noqa: BLE001 - Redis down: the database answers, as without a cache
        log.warning("token cache: generation unreadable; verifying in the database")
        return None


def lookup(prefix: str, digest: str, current: int | None) -> Any | None:
    """A copy of the cached token for ``prefix`` if it was verified with this same secret at
    generation ``current`` and is younger than the age limit; else None."""
    if current is None:
        return None
    entry = _entries.get(prefix)
    if entry is None or entry.generation != current or \
            not hmac.compare_digest(entry.digest, digest) or \
            time.monotonic() - entry.loaded > settings.CRUCIBLE["TOKEN_CACHE_S"]:
        return None
    token = copy.copy(entry.token)  # requests may set attributes on theirs
    if token.user is not None:
        token.user = copy.copy(token.user)
    return token


def store(prefix: str, digest: str, token: Any, read_at: int | None) -> None:
    """Keep a token verified in the database, tagged with the generation read *before* the
    query: a change committed after that read bumps the generation past it."""
    if read_at is None:
        return
    with _lock:
        if len(_entries) >= MAX_ENTRIES:
            _entries.clear()
        _entries[prefix] = _Entry(digest, token, read_at, time.monotonic())


def touch(prefix: str, when: Any) -> None:
    """Record a last use written to the database on the cached entry too, so the next
    cached request does not write it again within ``LAST_USED_RESOLUTION``."""
    entry = _entries.get(prefix)
    if entry is not None:
        entry.token.last_used_at = when


def bump() -> None:
    """Make every process's cached tokens stale (after a token or user changed)."""
    if not enabled():
        _entries.clear()
        return
    try:
        try:
            cache.incr(GENERATION_KEY)
        except ValueError:  # no key yet
            if not cache.add(GENERATION_KEY, 1, timeout=None):
                cache.incr(GENERATION_KEY)
    except Exception:  # noqa: BLE001
        # The bump is lost: other processes keep their entries until the age limit.
        log.exception("token cache: could not bump the generation")
    _entries.clear()


def _changed(sender: Any, **kwargs: Any) -> None:
    """This process forgets at once; the others once the change is committed (a bump
    before the commit could let another process re-read and cache the old row under the
    new generation)."""
    _entries.clear()
    transaction.on_commit(bump)


def connect() -> None:
    """Bump on every save or delete of a token or a user (called from TeamsConfig.ready)."""
    from django.contrib.auth import get_user_model
    from django.db.models.signals import post_delete, post_save

    from apps.teams.models import ApiToken

    for model in (ApiToken, get_user_model()):
        post_save.connect(_changed, sender=model, dispatch_uid=f"token-cache-save-{model}")
        post_delete.connect(_changed, sender=model, dispatch_uid=f"token-cache-del-{model}")
