"""What every run adapter shares: the run's pinned inputs read from the object store, the
worker's own egress checks, and strict-JSON reporting helpers. No database, no Django."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from workers import egress
from workers.client import WorkerSession
from workers.protocol import PinnedEnvironment
from workers.storage import ObjectStore

SAMPLE_BATCH = 500  # samples per API call (the API takes at most MAX_SAMPLE_BATCH)


class JobError(ValueError):
    """A run document this adapter cannot execute (another attempt would fail the same way)."""

    retryable = False


def var_dir() -> Path:
    """The host's scratch and cache root (``CRUCIBLE_VAR_DIR``, else ``var/`` in the checkout)."""
    return Path(os.environ.get("CRUCIBLE_VAR_DIR") or Path(__file__).resolve().parents[2] / "var")


def in_store(store: ObjectStore, uri: str | None) -> bool:
    """Whether ``uri`` names an object of this store (an earlier run's checkpoint)."""
    return bool(uri) and str(uri).startswith(store.url + "/")


def json_safe(value: Any) -> Any:
    """Strict JSON: NaN and infinities become null, unknown objects their str(), NUL
    characters U+FFFD (PostgreSQL cannot store NUL; a model may well emit one)."""
    if isinstance(value, dict):
        return {json_safe(str(k)): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd") if "\x00" in value else value
    if value is None or isinstance(value, int | bool):
        return value
    return json_safe(str(value))


def finite(value: Any) -> Any:
    """Strict JSON for engine reports: NaN and infinities become null, the rest as given."""
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def dump(value: Any) -> bytes:
    """A report object as stored: sorted keys, UTF-8, strict JSON."""
    return json.dumps(finite(value), sort_keys=True, ensure_ascii=False).encode()


def finite_metrics(values: dict[str, Any]) -> dict[str, float]:
    """The finite numbers among ``values`` (a skipped NaN step is reported as an event)."""
    return {k: float(v) for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


def log_metrics(session: WorkerSession, step: int, values: dict[str, Any]) -> None:
    """One metric batch of the finite values at ``step``; nothing when none is."""
    points = [{"name": k, "step": step, "value": v} for k, v in finite_metrics(values).items()]
    if points:
        session.log_metrics(points)


def pinned_environment(session: WorkerSession) -> PinnedEnvironment:
    """The run's one pinned environment version (qc, eval)."""
    pinned = session.run.environments
    if len(pinned) != 1:
        raise JobError(f"a {session.run.kind} run pins exactly one environment version; "
                       f"this one pins {len(pinned)}")
    return pinned[0]


def dataset_resolver(env: PinnedEnvironment, store: ObjectStore
                     ) -> Callable[[Any], Iterator[dict[str, Any]]]:
    """``resolve_dataset`` for an environment whose tasks live in a dataset version: the
    records from the object-store URI the API listed for its digest."""
    uris = env.dataset_uris

    def records(ref: Any) -> Iterator[dict[str, Any]]:
        uri = uris.get(ref.digest)
        if uri is None:
            raise FileNotFoundError(f"environment dataset {ref.dataset} v{ref.version} "
                                    f"({ref.digest[:12]}) is not among the team's datasets")
        return (json.loads(line) for line in store.open_lines(uri) if line.strip())

    return records


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
