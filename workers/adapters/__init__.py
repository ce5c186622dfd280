"""Run adapters, one module per run kind: claimed run -> engine call -> reports.

``execute`` claims a run through the API, hands it to its kind's adapter and reports the
final status; a failure another attempt may cure asks the API to queue the run again.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable

import httpx

from workers import liveness
from workers.adapters import eval as eval_adapter
from workers.adapters import health, profile, qc, synthesize, train
from workers.adapters.health import Broken
from workers.client import (
    ApiError,
    CrucibleClient,
    LeaseLost,
    WorkerSession,
    default_worker_id,
    node_name,
)
from workers.reporting import Stopped

log = logging.getLogger(__name__)

ADAPTERS: dict[str, Callable[[WorkerSession], None]] = {
    "profile": profile.run, "train": train.run,
    "qc": qc.run, "eval": eval_adapter.run, "synthesize": synthesize.run,
}

# Adapters that say themselves when their startup is over (``session.attempt_started``):
# a train run after fetching its checkpoint, with the step it resumes from.
SELF_STARTING = frozenset({"train"})

# Errors another attempt would meet again: a bad config or model folder, a run that
# diverged, a file (a checkpoint object) that is not there.
FINAL_ERRORS = {"SpecError", "ModelDirError", "TrainingFailed", "FileNotFoundError",
                "PinnedDataError"}
TRANSIENT_ERRORS = (OSError, MemoryError, RuntimeError, TimeoutError, ApiError,
                    httpx.TransportError)


def retryable(exc: BaseException) -> bool:
    """Whether a failed attempt is worth another: an exception may say so itself
    (``retryable``); known deterministic errors are final (matched by name so this module
    need not import the engines); lost resources and I/O are transient; anything else (a
    bug: TypeError, KeyError...) is final."""
    flag = getattr(exc, "retryable", None)
    if isinstance(flag, bool):
        return flag
    if any(cls.__name__ in FINAL_ERRORS for cls in type(exc).__mro__):
        return False
    return isinstance(exc, TRANSIENT_ERRORS)


def execute(client: CrucibleClient, run_id: str, pool: str, worker_id: str | None = None,
            node: str | None = None) -> str:
    """Claim ``run_id`` from this node (``node``, default :func:`node_name`) and run it to a
    final status. Returns what happened, for logs."""
    worker_id, node = worker_id or default_worker_id(), node or node_name()
    try:
        session = client.claim(pool, worker_id, run_id=run_id, node=node)
    except ApiError as exc:
        # 409: already claimed (a duplicate delivery) or canceled; 404: gone.
        log.info("run %s not claimed: %s", run_id, exc)
        return f"skipped: {exc.code}"
    if session is None:
        return "skipped: nothing to claim"
    return run_claimed(session, node)


def run_claimed(session: WorkerSession, node: str | None = None) -> str:
    """Run a claimed session to a final status, with its heartbeat, probing the sandbox of
    this node (``node``, default :func:`node_name`) before the run and after a failure. An
    engine stopped by a preemption has already checkpointed (the train engine writes its last
    completed step first), so ``preempted`` is reported only after that checkpoint is
    recorded."""
    # The lease file lets this host's node agent report the run at once if this process
    # dies without a word (SIGKILL, OOM): see workers.liveness.
    with liveness.holding(session.run_id, session.lease_id, session.worker_id):
        return _run_claimed(session, node or node_name())


def _run_claimed(session: WorkerSession, node: str) -> str:
    run_id = session.run_id
    adapter = ADAPTERS.get(session.run.kind)
    session.start_heartbeat()
    try:
        if adapter is None:
            session.set_status("failed", f"This worker has no engine for runs of kind "
                                         f"'{session.run.kind}'.")
            return "failed: no engine"
        broken = health.check(session.run, node)  # before it starts: a broken sandbox
        if broken is not None:
            health.report(session, broken, node)
            return "failed: environment"
        session.set_status("running")
        if session.run.kind not in SELF_STARTING:
            session.attempt_started()
        adapter(session)
        session.set_status("succeeded")
        return "succeeded"
    except (LeaseLost, Stopped) as exc:
        log.warning("run %s stopped: %s", run_id, exc)
        if session.lease_lost or isinstance(exc, LeaseLost):
            return "stopped"
        if session.preempt_requested:
            # The scheduler asked for the GPUs: say so, and the run goes back to the queue
            # (resuming from its last checkpoint) at once instead of at the deadline.
            try:
                session.set_status("preempted")
            except ApiError:
                log.exception("could not report the preemption of run %s", run_id)
            return "preempted"
        if session.drain_requested:
            # This worker is shutting down: the run goes back to the queue at once (a train
            # run checkpointed its last completed step first) instead of at the lease's end.
            try:
                session.set_status("preempted", drained=True)
            except ApiError:
                log.exception("could not report the drain of run %s", run_id)
            return "drained"
        return "stopped"
    except Exception as exc:
        log.exception("run %s failed", run_id)
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        try:
            # The sandbox may have broken under the run: then it is the node's failure.
            broken = health.check(session.run, node)
            if broken is not None:
                health.report(session, Broken(f"{detail}; {broken.message}", broken.toolchains),
                              node)
                return "failed: environment"
            session.set_status("failed", detail, retry=retryable(exc))
        except ApiError:
            log.exception("could not report failure of run %s", run_id)
        return "failed"
    finally:
        session.close()  # what the outbox still holds, then the heartbeat stops
