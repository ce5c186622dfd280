"""The Celery app shared by the web (to send work) and the worker pools (to run it).

It does not load Django: pools hold no database credentials and talk to the API instead.
Queues: ``gpu`` trains and generates, ``sandbox`` executes untrusted code, ``cpu`` does the
rest (profiling, synthesis). Late acks with prefetch 1, so a worker that dies mid-task
leaves its message for another worker; the run's lease makes a second delivery a no-op.
"""

from __future__ import annotations

import os

from celery import Celery
from celery.exceptions import Reject  # noqa: F401 - re-exported for workers.tasks
from celery.signals import (  # noqa: F401 - re-exported
    worker_init,
    worker_process_init,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)
from kombu import Queue

from config import env

QUEUES = ("gpu", "sandbox", "cpu")
# The worker signals are re-exported for workers.tasks (which may import this module, not
# celery itself): each worker process takes its thread allotment there, and the main process
# writes its health heartbeat (workers/health.py) from ready to shutdown.


def _seconds(var: str, default: float) -> float:
    """A positive number of seconds from the environment variable ``var``."""
    raw = os.environ.get(var, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError as exc:
        raise ValueError(f"{var} must be a number of seconds, not {raw!r}") from exc
    if value <= 0:
        raise ValueError(f"{var} must be positive, not {raw!r}")
    return value


def sweep_seconds() -> float:
    """How often the beat requeues runs whose lease expired (``CRUCIBLE_SWEEP_SECONDS``):
    a dead worker's run waits at most its lease plus this long before another takes it."""
    return _seconds("CRUCIBLE_SWEEP_SECONDS", 30.0)


def admission_seconds() -> float:
    """How often the beat runs the admission pass when ``CRUCIBLE_SCHEDULER`` is on."""
    return _seconds("CRUCIBLE_ADMISSION_SECONDS", 5.0)


def prune_seconds() -> float:
    """How often the beat drops raw metric points past each team's retention
    (``CRUCIBLE_METRIC_PRUNE_SECONDS``)."""
    return _seconds("CRUCIBLE_METRIC_PRUNE_SECONDS", 3600.0)


def alert_seconds() -> float:
    """How often the beat evaluates the periodic alert rules (queue wait, lost nodes) and
    resends stalled webhooks (``CRUCIBLE_ALERT_SECONDS``)."""
    return _seconds("CRUCIBLE_ALERT_SECONDS", 30.0)


def beat_schedule() -> dict[str, dict[str, object]]:
    """The lease sweep always; the admission pass only with the scheduler on (off, nothing
    changes for today's deployments)."""
    schedule: dict[str, dict[str, object]] = {
        "sweep-expired-leases": {
            "task": "workers.tasks.sweep_leases",
            "schedule": sweep_seconds(),
            # A sweep still queued when the next is due is worthless: drop it (a busy pool
            # would otherwise pile them up).
            "options": {"queue": "cpu", "expires": sweep_seconds()},
        },
    }
    schedule["prune-metric-points"] = {
        "task": "workers.tasks.prune_metrics",
        "schedule": prune_seconds(),
        "options": {"queue": "cpu", "expires": prune_seconds()},
    }
    schedule["evaluate-alerts"] = {
        "task": "workers.tasks.evaluate_alerts",
        "schedule": alert_seconds(),
        "options": {"queue": "cpu", "expires": alert_seconds()},
    }
    if env.scheduler_enabled():
        schedule["admission-pass"] = {
            "task": "workers.tasks.admission_pass",
            "schedule": admission_seconds(),
            "options": {"queue": "cpu", "expires": admission_seconds()},
        }
    return schedule


app = Celery("crucible", include=["workers.tasks"])
app.conf.update(
    broker_url=env.broker_url(),
    broker_transport_options=env.broker_transport_options(),
    broker_connection_retry_on_startup=True,
    task_queues=[Queue(name) for name in QUEUES],
    task_default_queue="cpu",
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    # A broker outage must not cancel a running task (a training run of hours): its run's
    # lease makes the redelivered message a no-op. Said explicitly, since Celery 6 turns it on
    # by default (Celery 5 warns about it on every reconnect).
    worker_cancel_long_running_tasks_on_connection_loss=False,
    # A channel the broker closes is a reconnect, not the worker's end: RabbitMQ closes the
    # channel of a message left unacknowledged past its consumer_timeout (30 min by default:
    # any train run with late acks), which Celery 5.7 otherwise takes as "Unrecoverable" and
    # shuts the worker down. With this the consumer reconnects, the task trains on, and the
    # requeued message is a no-op when delivered again (the run's lease).
    broker_channel_error_retry=True,
    worker_prefetch_multiplier=1,
    task_serializer="json",
    accept_content=["json"],
    result_backend=None,
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    beat_schedule=beat_schedule(),
)
