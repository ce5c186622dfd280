"""Celery tasks only: each claims its work through the API and hands it on.

Workers hold no database credentials: ``CRUCIBLE_API_URL`` and ``CRUCIBLE_WORKER_TOKEN``
(plus the broker and object-store variables) are all a pool needs. What a run of each kind
does is in :mod:`workers.adapters`.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from config.celery import (
    Reject,
    app,
    worker_init,
    worker_process_init,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)
from workers import drain, health, threads
from workers.adapters import execute
from workers.client import ApiError, CrucibleClient, default_worker_id

log = logging.getLogger(__name__)


def _pool_processes(worker: Any) -> int:
    """Processes of a Celery worker that run tasks at once: the prefork pool's children, or the
    one process of a solo pool."""
    pool = getattr(worker, "pool_cls", None)
    name = f"{getattr(pool, '__module__', '')}.{getattr(pool, '__name__', pool)}"
    if "solo" in name:
        return 1
    try:
        return max(1, int(getattr(worker, "concurrency", 1) or 1))
    except (TypeError, ValueError):  # "auto": resolved later, to at most the usable cores
        return threads.usable_cores()


_worker: Any = None  # the WorkController, for its pool's process ids at a drain


@worker_init.connect
def _threads_for_worker(sender: Any = None, **_: Any) -> None:
    """worker_init, in the worker's main process before its pool starts: the processes sharing
    the cores are the pool's (unless the launcher said otherwise), and the allotment goes to
    the pool's children through the environment."""
    global _worker
    _worker = sender
    drain.timeout_s()  # a bad CRUCIBLE_DRAIN_TIMEOUT_S stops the worker at start, not at a drain
    os.environ.setdefault(threads.SHARERS, str(_pool_processes(sender)))
    print(f"crucible worker {os.getpid()}: {threads.configure(role='celery worker').describe()}",
          file=sys.stderr, flush=True)


@worker_process_init.connect
def _threads_for_pool_process(**_: Any) -> None:
    """worker_process_init, in each prefork child as it starts."""
    allot = threads.configure(role="celery worker process")
    print(f"crucible worker process {os.getpid()}: {allot.describe()}", file=sys.stderr,
          flush=True)


_heartbeat: health.Heartbeat | None = None


def _describe_consumer(consumer: Any) -> dict[str, Any]:
    connection = getattr(consumer, "connection", None)
    return {"worker": str(getattr(consumer, "hostname", "") or ""),
            "broker_connected": bool(connection is not None and connection.connected)}


@worker_ready.connect
def _start_health_heartbeat(sender: Any = None, **_: Any) -> None:
    """worker_ready, in the main process once it consumes: from now on ``python -m
    workers.health`` finds a fresh heartbeat until the worker stops or hangs."""
    global _heartbeat
    name = str(getattr(sender, "hostname", "") or f"worker-{os.getpid()}")
    _heartbeat = health.Heartbeat(health.heartbeat_path(name), health.interval(),
                                  lambda: _describe_consumer(sender))
    _heartbeat.start()
    log.info("worker heartbeat: %s every %.0fs", _heartbeat.path, _heartbeat.every)


def _pool_pids() -> list[int]:
    """The prefork pool's process ids (none for a solo or threads pool: the task runs here)."""
    try:
        found = (_worker.pool.info or {}).get("processes") if _worker is not None else None
    except Exception:  # a pool that is not started, or one without process ids
        return []
    return [int(p) for p in found or [] if int(p) != os.getpid()]


@worker_shutting_down.connect
def _drain_on_shutdown(sig: str = "", how: str = "", **_: Any) -> None:
    """Celery's SIGTERM/SIGINT (warm) or SIGQUIT (cold) handler, in the main process: drain.
    A run in this process (solo or threads pool) stops at its next safe point; pool
    processes are told with SIGUSR2. Past the drain timeout this process exits, killing its
    pool processes first. With ``CRUCIBLE_DRAIN=0`` the running task finishes instead."""
    if not drain.enabled():
        return
    children = _pool_pids()
    drain.signal_children(children)
    drain.request_soon(f"{sig} ({how} shutdown)",
                       on_timeout=lambda: drain.kill_children(_pool_pids() or children))


@worker_shutdown.connect
def _stop_health_heartbeat(**_: Any) -> None:
    if _heartbeat is not None:
        _heartbeat.stop()


@app.task(name="workers.tasks.execute_run", bind=True)
def execute_run(self: Any, run_id: str, pool: str | None = None) -> str:
    """``pool`` comes with a message sent to a node's queue (scheduler on); a message sent to
    a pool's queue names its pool by its routing key."""
    pool = pool or (self.request.delivery_info or {}).get("routing_key") or "cpu"
    # Here, not at worker_process_init: billiard points SIGUSR2 at its own exit handler
    # after that signal's receivers ran.
    drain.install_child_handler()
    if drain.requested():
        # A draining worker still takes a message or two while Celery winds down (its loop
        # runs one more cycle after it decides to stop): hand it back for another worker.
        raise Reject("this worker is draining", requeue=True)
    with CrucibleClient() as client:
        return execute(client, run_id, pool)


@app.task(name="workers.tasks.execute_sandbox", bind=True)
def execute_sandbox(self: Any, execution_id: str) -> str:
    """Run one sandboxed execution: claim it, execute, report the result."""
    # needs bwrap: sandbox pools only
    from workers.sandbox import ExecutionRequest
    from workers.sandbox import execute as run_sandboxed

    worker_id = default_worker_id()
    with CrucibleClient() as client:
        try:
            job = client.start_execution(execution_id, worker_id)
        except ApiError as exc:
            log.info("execution %s not started: %s", execution_id, exc)
            return f"skipped: {exc.code}"
        try:
            result = run_sandboxed(ExecutionRequest.model_validate(job["request"]))
            body: dict[str, Any] = {"result": result.model_dump(mode="json")}
        except Exception as exc:  # the engine itself failed: report, don't hang the caller
            log.exception("execution %s failed in the engine", execution_id)
            body = {"error": f"{type(exc).__name__}: {exc}"}
        client.finish_execution(execution_id, worker_id, body, job["lease_id"])
        return str(body.get("result", {}).get("status", "error"))


@app.task(name="workers.tasks.sweep_leases")
def sweep_leases() -> list[str]:
    with CrucibleClient() as client:
        return client.sweep()


@app.task(name="workers.tasks.prune_metrics")
def prune_metrics() -> dict[str, int]:
    """Ask the web to drop raw metric points past each team's retention (the beat's)."""
    with CrucibleClient() as client:
        return client.prune_metrics()


@app.task(name="workers.tasks.admission_pass")
def admission_pass() -> dict[str, Any]:
    """Ask the web to run one admission pass (the beat sends this with the scheduler on)."""
    with CrucibleClient() as client:
        return client.admission_pass()


@app.task(name="workers.tasks.evaluate_alerts")
def evaluate_alerts() -> dict[str, Any]:
    """Ask the web to evaluate the periodic alert rules (the beat sends this)."""
    with CrucibleClient() as client:
        return client.evaluate_alerts()


@app.task(name="workers.tasks.deliver_webhook", bind=True, max_retries=None)
def deliver_webhook(self: Any, delivery_id: int) -> str:
    """One attempt of an alert's webhook, made by the web (which holds the signing secret and
    writes the delivery log); retried after the backoff the web says, while it stays pending.
    A task that finds the delivery not due stops: another task (or the periodic resend)
    owns it."""
    with CrucibleClient() as client:
        out = client.attempt_delivery(delivery_id)
    if out.get("attempted") and out.get("status") == "pending" and out.get("retry_in"):
        raise self.retry(countdown=float(out["retry_in"]))
    return str(out.get("status"))
