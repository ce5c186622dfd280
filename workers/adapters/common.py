"""What every run adapter shares: the run's pinned inputs read from the object store, the
worker's own egress checks, and strict-JSON reporting helpers. No database, no Django."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

from workers import egress
from workers.client import WorkerSession
from workers.envs.load import ResolveDataset, stored_datasets
from workers.jsonsafe import is_finite_number, json_safe
from workers.model_cache import pack_checkpoint
from workers.protocol import ClaimedRun, PinnedEnvironment
from workers.reporting import Stopped
from workers.storage import ObjectStore, default_store, run_key

SAMPLE_BATCH = 500  # samples per API call (the API takes at most MAX_SAMPLE_BATCH)


class JobError(ValueError):
    """A run document this adapter cannot execute (another attempt would fail the same way)."""

    retryable = False


def in_store(store: ObjectStore, uri: str | None) -> bool:
    """Whether ``uri`` names an object of this store (an earlier run's checkpoint)."""
    return bool(uri) and str(uri).startswith(store.url + "/")


def dump(value: Any) -> bytes:
    """A report object as stored: sorted keys, UTF-8, strict JSON."""
    return json.dumps(json_safe(value), sort_keys=True, ensure_ascii=False).encode()


def finite_metrics(values: dict[str, Any]) -> dict[str, float]:
    """The finite numbers among ``values`` (a skipped NaN step is reported as an event)."""
    return {k: float(v) for k, v in values.items() if is_finite_number(v)}


class ApiReporter:
    """The engines' :class:`workers.reporting.Reporter` for a claimed run: every call goes to
    the API. Non-finite values (a skipped NaN step) are left out of metric batches; events and
    samples are made strict JSON. Checkpoints are packed into the object store under the
    attempt's lease epoch (``<run prefix>/checkpoints/epoch-<n>/<name>.tar``) so that any worker
    can resume the run or start another run from them, and a revoked attempt that writes late
    never overwrites a later attempt's objects. Every call first checks whether the run was
    canceled or its lease lost, and raises :class:`Stopped` if so, so an engine stops at its
    next report. ``checkpoint_on_preempt``: the engine checkpoints and stops by itself when
    ``preempted()`` (the RL trainer), so a preemption does not refuse its reports; for other
    engines it stops them at their next report like a cancel."""

    def __init__(self, session: WorkerSession, store: ObjectStore | None = None,
                 scratch: Path | None = None, keep: int | None = None, *,
                 checkpoint_on_preempt: bool = False) -> None:
        self.session = session
        self.store = store or default_store()
        self.scratch = scratch or Path(tempfile.gettempdir())
        self.keep = keep  # checkpoint.keep, applied in the object store by the API
        self.checkpoint_on_preempt = checkpoint_on_preempt
        self.checkpoint_steps: set[int] = {c.step for c in session.run.checkpoints}

    def should_stop(self) -> bool:
        return self.session.should_stop

    def preempted(self) -> bool:
        """A scheduler preemption or this worker's drain: checkpoint, then stop."""
        return (self.session.preempt_requested or self.session.drain_requested) \
            and not self.session.lease_lost

    def _check(self) -> None:
        stop = self.session.lease_lost if self.checkpoint_on_preempt else self.session.should_stop
        if stop:
            raise Stopped(f"run {self.session.run_id} was canceled, preempted or its lease lost")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self._check()
        points = [{"name": k, "step": step, "value": v}
                  for k, v in finite_metrics(metrics).items()]
        if points:
            self.session.log_metrics(points)

    def event(self, level: str, message: str, data: dict[str, Any] | None = None, *,
              kind: str = "log") -> None:
        self._check()
        level = level if level in ("debug", "info", "warning", "error") else "info"
        self.session.log_event(json_safe(message), level=level, kind=kind,
                               data=json_safe(data or {}))

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Rows are ``{"prompt", "completion", "reward"?, "reward_components"?}``."""
        self._check()
        for i in range(0, len(rows), SAMPLE_BATCH):
            self.session.add_samples([{**json_safe(r), "step": step}
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
        """The checkpoint as one tar object under the run's prefix and the attempt's lease
        epoch (``step-N.tar`` for a periodic one, ``final.tar`` for the export)."""
        name = path.parent.name if path.name == "hf" else path.name
        return pack_checkpoint(self.store, path,
                               run_key(self.session.run, checkpoint_key(self.session.run, name)),
                               self.scratch)


def checkpoint_key(run: ClaimedRun, name: str) -> str:
    """Where an attempt's checkpoint ``name`` goes under the run's prefix: a folder per lease
    epoch, so no two attempts ever write the same key and a resume reads only the objects the
    API recorded (a claim from a web without epochs keeps the flat layout)."""
    if run.lease_epoch:
        return f"checkpoints/epoch-{run.lease_epoch}/{name}.tar"
    return f"checkpoints/{name}.tar"


def pinned_environment(session: WorkerSession) -> PinnedEnvironment:
    """The run's one pinned environment version (qc, eval)."""
    pinned = session.run.environments
    if len(pinned) != 1:
        raise JobError(f"a {session.run.kind} run pins exactly one environment version; "
                       f"this one pins {len(pinned)}")
    return pinned[0]


def dataset_resolver(env: PinnedEnvironment, store: ObjectStore) -> ResolveDataset:
    """``resolve_dataset`` for an environment whose tasks live in a dataset version: the
    records from the object-store URI the API listed for its digest."""
    return stored_datasets(env.dataset_uris, store)


def check_endpoint(url: str) -> None:
    """This worker's CRUCIBLE_ENDPOINT_ALLOW, with the host resolved, right before use."""
    try:
        egress.endpoint_allow_from_env().check(url, resolve=True)
    except egress.EgressRefused as exc:
        raise JobError(str(exc)) from exc


def check_model_path(path: str) -> None:
    """The launch checked the path against the web's allow-list; this worker's own
    CRUCIBLE_MODEL_PATH_ROOTS decides what it reads (symlinks resolved here)."""
    try:
        egress.check_model_path(path, egress.model_roots_from_env())
    except egress.EgressRefused as exc:
        raise JobError(str(exc)) from exc
