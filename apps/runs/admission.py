"""The admission loop: one pass loads the cluster (``admission_loader.snapshot``), asks the
pure engine (``workers.scheduling.decide``) what to do, and applies its actions in one
transaction (``admission_apply``). Runs from the Celery beat every few seconds, after a launch
commits and after a run ends, only with ``CRUCIBLE_SCHEDULER`` on.

One leader at a time: the pass holds a lock for its whole transaction — PostgreSQL's
``pg_try_advisory_xact_lock`` (released at commit), or on SQLite a non-blocking ``flock`` on a
file under the var dir. A pass that does not get it returns at once: the leader's pass sees
the same rows.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from apps.core.actor import Actor
from apps.runs import admission_apply, admission_loader, dispatch, scheduler, services
from workers.scheduling.decide import Policy, decide

log = logging.getLogger(__name__)

LOCK_KEY = 0x43525543  # "CRUC": the advisory lock's key, one per database
LOCK_FILE = "admission.lock"


@contextmanager
def _file_lock() -> Iterator[bool]:
    """SQLite: a non-blocking ``flock``, held across the pass's commit (so the next leader
    reads what this one wrote). Other databases: always True (the advisory lock decides)."""
    if connection.vendor == "postgresql":
        yield True
        return
    path = Path(settings.VAR_DIR) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _advisory_lock() -> bool:
    """PostgreSQL: the transaction-scoped advisory lock (released at commit or rollback);
    call inside ``transaction.atomic()``. Other databases: True (the file lock decided)."""
    if connection.vendor != "postgresql":
        return True
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [LOCK_KEY])
        return bool(cursor.fetchone()[0])


def policy() -> Policy:
    """The engine's policy with the knobs operators set (``CRUCIBLE_PREEMPT_MIN_RUNTIME_S``,
    ``CRUCIBLE_MAX_PREEMPTIONS``, ``CRUCIBLE_PREEMPT_MAX_LOSS_S``); the rest as the engine
    defines them."""
    knobs, defaults = settings.CRUCIBLE, Policy()
    loss = knobs.get("PREEMPT_MAX_LOSS_S", defaults.max_victim_loss_s)
    return Policy(
        min_runtime_s=float(knobs.get("PREEMPT_MIN_RUNTIME_S", defaults.min_runtime_s)),
        max_preemptions=int(knobs.get("MAX_PREEMPTIONS", defaults.max_preemptions)),
        max_victim_loss_s=None if loss is None else float(loss))


def admission_pass(now: datetime | None = None) -> dict[str, Any]:
    """One pass; returns what it did (``{"leader": False}`` when another pass held the
    lock, ``{"enabled": False}`` with the scheduler off)."""
    if not scheduler.enabled():
        return {"enabled": False}
    now = now or timezone.now()
    services.enforce_preemption_deadlines(actor=Actor.system(), now=now)
    with _file_lock() as leader:
        if not leader:
            return {"leader": False}
        with transaction.atomic():
            if not _advisory_lock():
                return {"leader": False}
            state, runs = admission_loader.snapshot(now)
            result = admission_apply.plan(decide(state, policy()))
            admission_apply.apply(result, runs, now)
    return {"leader": True, **result.summary()}


dispatch.register_pass(admission_pass)
