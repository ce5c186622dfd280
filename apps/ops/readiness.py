"""Readiness checks for ``/readyz``: can this web process serve traffic now?

``/healthz`` says the process is alive (a liveness probe: restart it if not); ``/readyz`` says
whether it should get requests (a readiness probe: keep it out of the load balancer until the
database answers with every migration applied and the channel layer and broker answer). Each
check returns a short detail or raises :class:`NotReady` with a message an operator can act on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import connection
from django.db.migrations.loader import MigrationLoader
from kombu import Connection

from config import env

TIMEOUT_S = 3.0
READYZ_GROUP = "crucible-readyz"


class NotReady(Exception):
    """A check failed; the message says what to fix."""


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    latency_ms: float
    detail: str


def check_database() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return connection.vendor


def check_migrations() -> str:
    """No migration on disk is unapplied: a web process of a new release must not serve
    before ``manage.py migrate`` (the migrate Job or one-shot service) has finished."""
    # Every node of the graph, not only the plan to the leaves: a plan skips an unapplied
    # migration below an applied one (a database restored from a partial backup).
    loader = MigrationLoader(connection, ignore_no_migrations=True)
    applied = loader.applied_migrations or {}
    missing = sorted(key for key in loader.graph.nodes if key not in applied)
    if missing:
        names = ", ".join(f"{app}.{name}" for app, name in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise NotReady(f"{len(missing)} unapplied migration(s): {names}{more}; run "
                       "`python manage.py migrate`")
    return f"{len(applied)} applied"


def check_channel_layer() -> str:
    """One group send (a round trip to Redis with channels-redis; nothing leaves the process
    with the in-memory layer). Live pages and event fan-out go through it."""
    layer = get_channel_layer()
    if layer is None:
        raise NotReady("no channel layer is configured (CHANNEL_LAYERS)")

    async def ping() -> None:
        await asyncio.wait_for(layer.group_send(READYZ_GROUP, {"type": "readyz.ping"}),
                               TIMEOUT_S)

    async_to_sync(ping)()
    return type(layer).__name__


def check_broker(url: str | None = None) -> str:
    """The Celery broker that launches send runs to: a connection (Redis: a PING) when it is a
    server; the spool folder when it is the embedded filesystem transport."""
    url = url or env.broker_url()
    if url.startswith("filesystem://"):
        folder = Path(str(env.broker_transport_options()["data_folder_in"]))
        if not folder.is_dir():
            raise NotReady(f"the broker spool {folder} is missing")
        return f"filesystem spool {folder}"
    with Connection(url, connect_timeout=TIMEOUT_S,
                    transport_options={"socket_timeout": TIMEOUT_S,
                                       "max_retries": 0}) as conn:
        try:
            conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0,
                                   timeout=TIMEOUT_S)
            conn.default_channel  # noqa: B018 - opening the channel talks to the server
        except Exception as exc:
            raise NotReady(f"cannot reach the Celery broker at "
                           f"{conn.as_uri(include_password=False)}: {exc}") from exc
        return conn.transport_cls if isinstance(conn.transport_cls, str) else "broker"


CHECKS: tuple[tuple[str, Callable[[], str]], ...] = (
    ("database", check_database),
    ("migrations", check_migrations),
    ("channel_layer", check_channel_layer),
    ("broker", check_broker),
)


def run_checks() -> list[CheckResult]:
    """Every check, timed; one failing does not skip the rest (the body names them all)."""
    results = []
    for name, check in CHECKS:
        start = time.perf_counter()
        try:
            detail, ok = check(), True
        except Exception as exc:
            detail, ok = (str(exc) if isinstance(exc, NotReady)
                          else f"{type(exc).__name__}: {exc}"), False
        results.append(CheckResult(name, ok, round((time.perf_counter() - start) * 1000, 2),
                                   detail))
    return results
