"""Send queued runs to their pool's Celery queue, only once the launch has committed.

The web sends by task name so it never imports worker code; the lease makes a duplicate
delivery harmless (the second worker's claim gets a 409 and returns).

With the scheduler on (``CRUCIBLE_SCHEDULER``) a queued run is not sent at once: the commit
triggers an admission pass instead, and the pass sends the run (``send_on_commit``) once it
holds an allocation whose GPUs are free, to the queue of the allocation's first node
(``node.<name>``), which only that node's workers consume.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from django.db import transaction

from apps.runs import scheduler
from config.celery import app
from workers.protocol import node_queue

log = logging.getLogger(__name__)

EXECUTE_TASK = "workers.tasks.execute_run"

_pass_hook: list[Callable[[], object]] = []
"""The admission pass to run after a commit (registered by apps.runs.admission, which
imports this module: a hook keeps the import one-way)."""


def _send(run_id: str, pool: str, priority: int, node: str | None = None) -> None:
    options: dict[str, Any] = {"queue": pool}
    if node is not None:
        # Only the allocation's node's workers consume its queue; the message names the pool,
        # which its routing key no longer says.
        options = {"queue": node_queue(node), "kwargs": {"pool": pool}}
    try:
        app.send_task(EXECUTE_TASK, args=[run_id], priority=max(0, min(9, priority)),
                      **options)
    except Exception:
        # The run stays queued; a worker that polls /worker/claim, or a resend, picks it up.
        log.exception("could not enqueue run %s on %s", run_id, options["queue"])


def send_on_commit(run: object, node: str | None = None) -> None:
    """Send the run's message once the current transaction commits: to its pool's queue, or
    with ``node`` (an admitted run's first allocated node) to that node's queue."""
    run_id, pool, priority = str(run.pk), run.pool, run.priority  # type: ignore[attr-defined]
    transaction.on_commit(lambda: _send(run_id, pool, priority, node))


def register_pass(hook: Callable[[], object]) -> None:
    _pass_hook[:] = [hook]


def _run_pass() -> None:
    for hook in _pass_hook:
        try:
            hook()
        except Exception:
            # The beat's next pass retries; a failed pass must not fail the request.
            log.exception("admission pass after commit failed")


def request_pass_on_commit() -> None:
    """With the scheduler on, run an admission pass after the current transaction commits
    (a launch, a requeue, a run that ended and freed its GPUs)."""
    if scheduler.enabled():
        transaction.on_commit(_run_pass)


def enqueue_on_commit(run: object) -> None:
    """A run became queued: send it (scheduler off), or let a pass decide (on)."""
    if scheduler.enabled():
        request_pass_on_commit()
    else:
        send_on_commit(run)
