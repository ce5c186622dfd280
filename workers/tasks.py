"""Celery tasks: thin adapters that claim a run through the API, call an engine and report.

Workers hold no database credentials: ``CRUCIBLE_API_URL`` and ``CRUCIBLE_WORKER_TOKEN``
(plus the broker and object-store variables) are all a pool needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import sys
import tarfile
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from config.celery import app, worker_init, worker_process_init
from workers import egress, jobs, threads
from workers.client import ApiError, CrucibleClient, LeaseLost, WorkerSession, default_worker_id
from workers.model_cache import ModelCache, fetch_tar
from workers.profile.engine import Stopped, run_profile
from workers.storage import ObjectStore, default_store, run_key

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
        return self.session.should_stop


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


@worker_init.connect
def _threads_for_worker(sender: Any = None, **_: Any) -> None:
    """worker_init, in the worker's main process before its pool starts: the processes sharing
    the cores are the pool's (unless the launcher said otherwise), and the allotment goes to
    the pool's children through the environment."""
    os.environ.setdefault(threads.SHARERS, str(_pool_processes(sender)))
    print(f"crucible worker {os.getpid()}: {threads.configure(role='celery worker').describe()}",
          file=sys.stderr, flush=True)


@worker_process_init.connect
def _threads_for_pool_process(**_: Any) -> None:
    """worker_process_init, in each prefork child as it starts."""
    allot = threads.configure(role="celery worker process")
    print(f"crucible worker process {os.getpid()}: {allot.describe()}", file=sys.stderr,
          flush=True)


def _profile(session: WorkerSession) -> None:
    _, uri = run_profile(run=session.run, store=default_store(), sink=ApiSink(session))
    session.set_report(uri)


class RlApiSink:
    """RL engine sink → API: metrics per step, events, samples, and checkpoints, which it
    packs into the object store (``runs/<id>/checkpoints/<name>.tar``) so that any worker
    can resume the run or start another run from them. Non-finite values (a skipped NaN
    step) are left out of the metric batch; the engine reports them as events. Every call
    first checks whether the run was canceled or its lease lost, so the engine stops at the
    next step."""

    def __init__(self, session: WorkerSession, store: ObjectStore | None = None,
                 scratch: Path | None = None, keep: int | None = None) -> None:
        self.session = session
        self.store = store or default_store()
        self.scratch = scratch or Path(tempfile.gettempdir())
        self.keep = keep  # checkpoint.keep, applied in the object store by the API
        self.checkpoint_steps: set[int] = {int(c["step"]) for c in
                                           session.run.get("checkpoints", [])}

    def _check(self) -> None:
        if self.session.should_stop:
            raise Stopped(f"run {self.session.run_id} was canceled or its lease lost")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._check()
        points = [{"name": k, "step": step, "value": float(v)} for k, v in metrics.items()
                  if isinstance(v, int | float) and math.isfinite(v)]
        if points:
            self.session.log_metrics(points)

    def event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        self._check()
        level = level if level in ("debug", "info", "warning", "error") else "info"
        self.session.log_event(_json_safe(message), level=level, data=_json_safe(data or {}))

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Rows are ``{"prompt", "completion", "reward"?, "reward_components"?}``."""
        self._check()
        for i in range(0, len(rows), SAMPLE_BATCH):
            self.session.add_samples([{**_json_safe(r), "step": step}
                                      for r in rows[i:i + SAMPLE_BATCH]])

    def checkpoint(self, step: int, uri: str, metrics: dict[str, float]) -> None:
        self._check()
        if step in self.checkpoint_steps:
            # The final export can land on the step of the last periodic checkpoint, which
            # holds the same weights; the API keeps one checkpoint per step.
            self.session.log_event(f"final model at step {step} is checkpoint {step}",
                                   kind="artifact", data={"step": step})
            return
        path = Path(uri)
        stored = self.upload(path)
        # A periodic checkpoint (step-N/hf) carries the training state; the final export
        # only the model. The API prunes periodic ones beyond `keep`, as the engine does on
        # its local disk.
        periodic = path.name == "hf"
        self.session.add_checkpoint(step, stored, {k: v for k, v in metrics.items()
                                                   if isinstance(v, int | float)
                                                   and math.isfinite(v)},
                                    resumable=periodic, keep=self.keep if periodic else None)
        self.checkpoint_steps.add(step)

    def upload(self, path: Path) -> str:
        """Pack a checkpoint into one tar object. A periodic checkpoint (``step-N/hf``) brings
        its whole folder (DeepSpeed state, RNG, state.json: what a resume needs); the final
        export is a bare model folder, packed as ``hf/``."""
        folder, name = (path.parent, path.parent.name) if path.name == "hf" else (path, path.name)
        self.scratch.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.scratch, suffix=".tar") as tmp:
            with tarfile.open(tmp.name, "w") as tar:
                if path.name == "hf":
                    for child in sorted(folder.iterdir()):
                        tar.add(child, arcname=child.name)
                else:
                    tar.add(folder, arcname="hf")
            return self.store.put_file(run_key(self.session.run, f"checkpoints/{name}.tar"),
                                       Path(tmp.name))


SAMPLE_BATCH = 500


def _json_safe(value: Any) -> Any:
    """Strict JSON: NaN and infinities become null, unknown objects their str(), NUL
    characters U+FFFD."""
    if isinstance(value, dict):
        return {_json_safe(str(k)): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        # The API refuses NUL (PostgreSQL cannot store it); a model may well emit one.
        return value.replace("\x00", "\ufffd") if "\x00" in value else value
    if value is None or isinstance(value, int | bool):
        return value
    return _json_safe(str(value))


def _var_dir() -> Path:
    return Path(os.environ.get("CRUCIBLE_VAR_DIR") or Path(__file__).resolve().parents[1] / "var")


def _in_store(store: ObjectStore, uri: str | None) -> bool:
    return bool(uri) and str(uri).startswith(store.url + "/")


def _resume_point(session: WorkerSession) -> dict[str, Any] | None:
    """The run's last recorded checkpoint that holds training state (``step-N.tar``; the
    final export holds only the model)."""
    for ckpt in reversed(session.run.get("checkpoints", [])):
        if CHECKPOINT_NAME.search(ckpt["uri"]):
            return ckpt
    return None


CHECKPOINT_NAME = re.compile(r"/step-\d+\.tar$")


def prepare_train(session: WorkerSession, store: ObjectStore, work: Path,
                  hold: contextlib.ExitStack | None = None) -> tuple[Any, bool]:
    """The engine's spec for this attempt, with local paths, and whether to resume.

    The checkpoint folder is new for every attempt; a retried attempt unpacks the run's last
    recorded checkpoint from the object store into it, so any worker, on any host, resumes
    where the lost one last checkpointed. A base model given as an object-store URI (an
    earlier run's checkpoint) is unpacked into the host's model cache, where ``hold`` keeps
    it from being pruned until the attempt ends.
    """
    from workers.rl.spec import parse_spec

    spec = parse_spec(session.run["config"])
    root = work / "checkpoints"
    model = spec.model
    if model.source == "path" and _in_store(store, model.path):
        hold = hold if hold is not None else contextlib.ExitStack()
        cached = ModelCache(_var_dir() / "models").use(store, str(model.path))
        local = hold.enter_context(cached) / "hf"
        session.log_event(f"base model {model.path} unpacked to {local}", kind="artifact")
        model = model.model_copy(update={"path": str(local)})
    elif model.source == "path":
        # The launch checked the path against the web's allow-list; this worker's own
        # CRUCIBLE_MODEL_PATH_ROOTS decides what it reads (symlinks resolved here).
        try:
            egress.check_model_path(str(model.path), egress.model_roots_from_env())
        except egress.EgressRefused as exc:
            raise jobs.JobError(str(exc)) from exc
    spec = spec.model_copy(update={
        "model": model,
        "checkpoint": spec.checkpoint.model_copy(update={"dir": str(root)}),
    })
    last = _resume_point(session)
    if last is None:
        return spec, False
    folder = fetch_tar(store, last["uri"], root / f"step-{int(last['step']):06d}")
    for phase, steps in (("sft", spec.sft.steps), ("preference", spec.preference.steps)):
        if steps and not (root / phase).exists():
            # The warm start is inside the checkpoint's weights: give the engine a finished
            # folder (same architecture and tokenizer) so it does not train that phase again.
            shutil.copytree(folder / "hf", root / phase)
    session.log_event(f"attempt {session.run['attempt']}: resuming from the checkpoint at "
                      f"step {last['step']} ({last['uri']})",
                      data={"step": last["step"], "uri": last["uri"]})
    return spec, True


class MixedTask:
    """Several environments as one RL task: their examples side by side, each completion
    scored by the environment it came from. Reward components are named
    ``<environment>/<component>`` and are 0 for the other environments' examples."""

    def __init__(self, tasks: list[Any], names: list[str]) -> None:
        self.tasks, self.names = tasks, names
        self.train = [self._tag(e, i) for i, t in enumerate(tasks) for e in t.train]
        self.eval = [self._tag(e, i) for i, t in enumerate(tasks) for e in t.eval]
        self.components = [f"{names[i]}/{c.name}" for i, t in enumerate(tasks)
                           for c in t.env.rubric.components]
        self.reward = self.score
        # Multi-turn / tool-use environments are played as episodes (workers.rl.episodes);
        # single-turn ones answer episode_env with None and keep the one-shot path.
        self.interaction = next((t.interaction for t in tasks
                                 if getattr(t, "interaction", "single_turn") != "single_turn"),
                                "single_turn")
        self.episode_max_tokens = max(getattr(t, "episode_max_tokens", 4096) for t in tasks)

    def episode_env(self, example: Any) -> Any:
        task = self.tasks[int(example.meta["env"])]
        play = getattr(task, "episode_env", None)
        return play(self._untag(example)) if play is not None else None

    @staticmethod
    def _tag(example: Any, index: int) -> Any:
        meta = {**example.meta, "env": str(index),
                "task_id": f"{index}:{example.meta.get('task_id', '')}"}
        return dataclasses.replace(example, meta=meta)

    @staticmethod
    def _untag(example: Any) -> Any:
        meta = {k: v for k, v in example.meta.items() if k != "env"}
        meta["task_id"] = example.meta["task_id"].split(":", 1)[1]
        return dataclasses.replace(example, meta=meta)

    def score(self, examples: list[Any], completions: list[str]
              ) -> tuple[list[float], dict[str, list[float]]]:
        totals = [0.0] * len(examples)
        parts = {name: [0.0] * len(examples) for name in self.components}
        for i, task in enumerate(self.tasks):
            rows = [j for j, e in enumerate(examples) if e.meta["env"] == str(i)]
            if not rows:
                continue
            got, comps = task.reward([self._untag(examples[j]) for j in rows],
                                     [completions[j] for j in rows])
            for k, j in enumerate(rows):
                totals[j] = got[k]
                for name, values in comps.items():
                    parts.setdefault(f"{self.names[i]}/{name}",
                                     [0.0] * len(examples))[j] = values[k]
        return totals, parts

    def corpus(self) -> list[str]:
        return [line for t in self.tasks for line in t.corpus()]


def environment_task(session: WorkerSession, store: ObjectStore) -> Any:
    """The RL task made of the run's pinned environment versions (QC-quarantined tasks left
    out), or None when it pins none and the engine uses the task in its config."""
    pinned = session.run.get("environments") or []
    if not pinned:
        return None
    from workers.envs.adapter import as_rl_task
    from workers.envs.load import load_environment

    tasks = []
    for env in pinned:
        uris: dict[str, str] = env.get("dataset_uris") or {}

        def records(ref: Any, uris: dict[str, str] = uris) -> Any:
            uri = uris.get(ref.digest)
            if uri is None:
                raise FileNotFoundError(f"environment dataset {ref.dataset} v{ref.version} "
                                        f"({ref.digest[:12]}) is not among the team's datasets")
            return (json.loads(line) for line in store.open_lines(uri) if line.strip())

        loaded = load_environment(env["spec"], resolve_dataset=records)
        tasks.append(as_rl_task(loaded, quarantined=env.get("quarantined_ids") or ()))
        session.log_event(f"environment {env['environment']} v{env['number']}: "
                          f"{len(tasks[-1].train)} train / {len(tasks[-1].eval)} eval tasks, "
                          f"{len(env.get('quarantined_ids') or [])} quarantined by QC")
    if len(tasks) == 1:
        return tasks[0]
    return MixedTask(tasks, [f"{e['environment']}@v{e['number']}" for e in pinned])


def pinned_datasets(session: WorkerSession, store: ObjectStore, spec: Any) -> Any:
    """The run's pinned dataset versions as SFT / preference pairs (workers.rl.pinned_data),
    read line by line from the object store."""
    from workers.rl.pinned_data import load_pinned

    pins: dict[str, Any] = session.run.get("datasets") or {}

    def records(uri: str) -> Any:
        return (json.loads(line) for line in store.open_lines(uri) if line.strip())

    data = load_pinned({f"{p['dataset']}@v{p['number']}": records(p["uri"]) for p in pins.values()},
                       prompt_template=spec.sft.prompt_template,
                       completion_template=spec.sft.completion_template)
    for label, (role, count) in data.sources.items():
        session.log_event(f"dataset {label}: {count} {role} records for the warm start",
                          data={"dataset": label, "role": role, "records": count})
    return data


def _train(session: WorkerSession) -> None:
    """A ``train`` run in this worker process (a world of one), in a scratch folder
    ``var/runs/<id>/attempt-<n>`` that is removed afterwards: what must outlive the attempt
    is in the object store and the API."""
    from workers.rl.trainer import train

    store = default_store()
    base = _var_dir() / "runs" / session.run_id
    work = base / f"attempt-{session.run['attempt']}"
    if base.is_dir():  # leftovers of attempts that died on this host
        for old in base.iterdir():
            shutil.rmtree(old, ignore_errors=True)
    try:
        with contextlib.ExitStack() as hold:
            spec, resume = prepare_train(session, store, work, hold)
            task = environment_task(session, store)
            pinned = pinned_datasets(session, store, spec)
            train(spec, RlApiSink(session, store, work / "upload", keep=spec.checkpoint.keep),
                  resume=resume, task=task, pinned=pinned)
    finally:
        shutil.rmtree(work, ignore_errors=True)


ENGINES: dict[str, Callable[[WorkerSession], None]] = {
    "profile": _profile, "train": _train,
    "qc": jobs.run_qc, "eval": jobs.run_eval, "synthesize": jobs.run_synthesize,
}


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
            session.set_status("failed", detail, retry=retryable(exc))
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
