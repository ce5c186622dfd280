"""Send queued runs to their pool's Celery queue, only once the launch has committed.

The web sends by task name so it never imports worker code; the lease makes a duplicate
delivery harmless (the second worker's claim gets a 409 and returns).
"""

from __future__ import annotations

import logging

from django.db import transaction

from config.celery import app

log = logging.getLogger(__name__)

EXECUTE_TASK = "workers.tasks.execute_run"


def _send(run_id: str, pool: str, priority: int) -> None:
    try:
        app.send_task(EXECUTE_TASK, args=[run_id], queue=pool,
                      priority=max(0, min(9, priority)))
    except Exception:
        # The run stays queued; a worker that polls /worker/claim, or a resend, picks it up.
        log.exception("could not enqueue run %s on %s", run_id, pool)


def enqueue_on_commit(run: object) -> None:
    run_id, pool, priority = str(run.pk), run.pool, run.priority  # type: ignore[attr-defined]
    transaction.on_commit(lambda: _send(run_id, pool, priority))
