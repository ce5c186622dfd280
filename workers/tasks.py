"""Celery tasks: thin adapters that claim a run through the API, call an engine and report.

Workers hold no database credentials: ``CRUCIBLE_API_URL`` and ``CRUCIBLE_WORKER_TOKEN``
(plus the broker and object-store variables) are all a pool needs.
"""

from __future__ import annotations

import logging
import math
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from config.celery import app
from workers.client import ApiError, CrucibleClient, LeaseLost, WorkerSession, default_worker_id
from workers.profile.engine import Stopped, run_profile
from workers.storage import default_store

log = logging.getLogger(__name__)


class ApiSink:
    """Engine progress → API calls on the claimed run."""

    def __init__(self, session: WorkerSession) -> None:
        self.session = session

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.session.log_metrics([{"name": k, "step": step, "value": v}
                                  for k, v in values.items()])

    def event(self, message: str, data: dict[str, Any] | None = None) -> None:
        self.session.log_event(message, data=data)

    def should_stop(self) -> bool:
        return self.session.lease_lost


def _profile(session: WorkerSession) -> None:
    _, uri = run_profile(run=session.run, store=default_store(), sink=ApiSink(session))
    session.set_report(uri)


class RlApiSink:
    """RL engine sink → API: metrics per step, events, checkpoints. Non-finite values (a
    skipped NaN step) are left out of the metric batch; the engine reports them as events."""

    def __init__(self, session: WorkerSession) -> None:
        self.session = session
        self.checkpoint_steps: set[int] = set()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        points = [{"name": k, "step": step, "value": float(v)} for k, v in metrics.items()
                  if isinstance(v, int | float) and math.isfinite(v)]
        if points:
            self.session.log_metrics(points)

    def event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        level = level if level in ("debug", "info", "warning", "error") else "info"
        self.session.log_event(message, level=level, data=_json_safe(data or {}))

    def checkpoint(self, step: int, uri: str, metrics: dict[str, float]) -> None:
        path = Path(uri)
        target = path.resolve().as_uri() if path.exists() else uri
        if step in self.checkpoint_steps:
            # The final export can land on the step of the last periodic checkpoint; the
            # API keeps one checkpoint per step, so the export is recorded as an event.
            self.session.log_event(f"final model at step {step}: {target}",
                                   kind="artifact", data={"step": step, "uri": target})
            return
        self.checkpoint_steps.add(step)
        self.session.add_checkpoint(step, target, {k: v for k, v in metrics.items()
                                                   if isinstance(v, int | float)
                                                   and math.isfinite(v)})


def _json_safe(value: Any) -> Any:
    """Strict JSON: NaN and infinities become null, unknown objects their str()."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, str | int | bool):
        return value
    return str(value)


def _train(session: WorkerSession) -> None:
    """A ``train`` run in this worker process (a world of one). Checkpoints go under
    var/runs/<id>/; a second attempt of the same run resumes from the last one."""
    from workers.rl.spec import parse_spec
    from workers.rl.trainer import train

    var = Path(os.environ.get("CRUCIBLE_VAR_DIR") or Path(__file__).resolve().parents[1] / "var")
    spec = parse_spec(session.run["config"])
    folder = var / "runs" / session.run_id / "checkpoints"
    spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(
        update={"dir": str(folder)})})
    resume = session.run["attempt"] > 1 and folder.exists()
    if resume:
        session.log_event(f"attempt {session.run['attempt']}: resuming from {folder}")
    train(spec, RlApiSink(session), resume=resume)


ENGINES: dict[str, Callable[[WorkerSession], None]] = {"profile": _profile, "train": _train}


def execute(client: CrucibleClient, run_id: str, pool: str, worker_id: str | None = None) -> str:
    """Claim ``run_id`` and run it to a final status. Returns what happened, for logs."""
    worker_id = worker_id or default_worker_id()
    try:
        session = client.claim(pool, worker_id, run_id=run_id)
    except ApiError as exc:
        # 409: already claimed (a duplicate delivery) or canceled; 404: gone.
        log.info("run %s not claimed: %s", run_id, exc)
        return f"skipped: {exc.code}"
    if session is None:
        return "skipped: nothing to claim"
    engine = ENGINES.get(session.run["kind"])
    session.start_heartbeat()
    try:
        if engine is None:
            session.set_status("failed", f"This worker has no engine for runs of kind "
                                         f"'{session.run['kind']}'.")
            return "failed: no engine"
        session.set_status("running")
        engine(session)
        session.set_status("succeeded")
        return "succeeded"
    except (LeaseLost, Stopped) as exc:
        log.warning("run %s stopped: %s", run_id, exc)
        return "stopped"
    except Exception as exc:
        log.exception("run %s failed", run_id)
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        try:
            session.set_status("failed", detail)
        except ApiError:
            log.exception("could not report failure of run %s", run_id)
        return "failed"
    finally:
        session.stop_heartbeat()


@app.task(name="workers.tasks.execute_run", bind=True)
def execute_run(self: Any, run_id: str) -> str:
    pool = (self.request.delivery_info or {}).get("routing_key") or "cpu"
    with CrucibleClient() as client:
        return execute(client, run_id, pool)


@app.task(name="workers.tasks.execute_sandbox", bind=True)
def execute_sandbox(self: Any, execution_id: str) -> str:
    """Run one sandboxed execution: claim it, execute, report the result."""
    from workers.sandbox import ExecutionRequest, execute  # needs bwrap: sandbox pools only

    with CrucibleClient() as client:
        headers = {"X-Crucible-Worker": default_worker_id()}
        try:
            job = client.request("POST", f"worker/executions/{execution_id}/start",
                                 headers=headers)
        except ApiError as exc:
            log.info("execution %s not started: %s", execution_id, exc)
            return f"skipped: {exc.code}"
        try:
            result = execute(ExecutionRequest.model_validate(job["request"]))
            body: dict[str, Any] = {"result": result.model_dump(mode="json")}
        except Exception as exc:  # the engine itself failed: report, don't hang the caller
            log.exception("execution %s failed in the engine", execution_id)
            body = {"error": f"{type(exc).__name__}: {exc}"}
        client.request("POST", f"worker/executions/{execution_id}/result", json=body,
                       headers=headers, idempotent=True)
        return str(body.get("result", {}).get("status", "error"))


@app.task(name="workers.tasks.sweep_leases")
def sweep_leases() -> list[str]:
    with CrucibleClient() as client:
        return client.request("POST", "worker/sweep")["requeued"]
