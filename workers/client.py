"""The HTTP client of Crucible's API, for worker pools and for people's scripts alike.

Retries are safe because every write is idempotent: metric batches carry a sequence
number, POSTs that create work carry an ``Idempotency-Key`` generated once per logical
call and reused on each retry, and status changes are refused (409) if already applied.
Tests may pass an ``httpx`` transport (e.g. ``httpx.WSGITransport``) to run in-process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import msgpack
import orjson

from workers import drain
from workers.outbox import Item, Outbox
from workers.paths import var_dir
from workers.protocol import (
    BatchHandOver,
    ClaimedRun,
    DeadLeaseReport,
    NodeHeartbeat,
    NodeRegistration,
    NodeStatus,
)

log = logging.getLogger(__name__)

RETRY_STATUSES = {408, 425, 429, 500, 502, 503, 504}
# The longest pause between two tries of a call that retries until a deadline: the web is
# noticed within this long of coming back.
MAX_PAUSE_S = 2.0
# A worker's report tries this many times more before it goes to the outbox.
QUICK_RETRIES = 2
# How log_metrics encodes a batch: msgpack columns (the cheapest for the web to decode and
# check), JSON columns, or JSON rows (the original body).
METRIC_ENCODINGS = ("msgpack", "json-columns", "json-rows")
HEARTBEAT_RETRY_S = 2.0
DEFAULT_LEASE_S = 120.0  # the web's default, for a claim that does not say
MIN_RETRY_S = 15.0  # about the five tries with backoff a report had before the outbox
FINAL_STATUSES = ("succeeded", "failed", "canceled")


class ApiError(Exception):
    """A 4xx/5xx answer, with the API's ``code`` and human ``message``."""

    def __init__(self, status: int, code: str, message: str, body: Any = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.body = status, code, message, body

    def __reduce__(self) -> tuple[Any, ...]:
        """Rebuild from the fields, not from ``args`` (the one formatted string): Exception's
        default pickling calls ``cls(*args)``, which fails here, so Celery logged an
        ``UnpickleableExceptionWrapper`` instead of the error (subclasses inherit this)."""
        return type(self), (self.status, self.code, self.message, self.body), self.__dict__


class LeaseLost(ApiError):
    """The run was canceled, or its lease expired or moved: stop working on it."""


def blocked_rows(exc: ApiError) -> set[int] | None:
    """The row indices a 422 ``output_blocked`` answer names (the team's output filter
    refused them), or None for any other error."""
    if exc.code != "output_blocked" or not isinstance(exc.body, dict):
        return None
    details = exc.body.get("errors")
    rows = details.get("blocked") if isinstance(details, dict) else None
    if not isinstance(rows, list):
        return None
    return {r["index"] for r in rows if isinstance(r, dict) and isinstance(r.get("index"), int)}


class CrucibleClient:
    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        *,
        transport: httpx.BaseTransport | None = None,
        retries: int = 5,
        backoff: float = 0.5,
        timeout: float = 30.0,
        metric_encoding: str = "msgpack",
    ) -> None:
        if metric_encoding not in METRIC_ENCODINGS:
            raise ValueError(f"metric_encoding must be one of {', '.join(METRIC_ENCODINGS)}; "
                             f"got {metric_encoding!r}")
        self.metric_encoding = metric_encoding
        self.base_url = (base_url or os.environ.get("CRUCIBLE_API_URL")
                         or "http://127.0.0.1:8000").rstrip("/")
        token = token or os.environ.get("CRUCIBLE_TOKEN") or os.environ.get(
            "CRUCIBLE_WORKER_TOKEN")
        headers = {"Accept": "application/json", "User-Agent": "crucible-client/1"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.retries, self.backoff = retries, backoff
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout,
                                 transport=transport)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> CrucibleClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- transport -------------------------------------------------------------------
    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        files: Any = None,
        data: Any = None,
        idempotent: bool = False,
        content: bytes | None = None,
        retries: int | None = None,
        deadline: float | None = None,
    ) -> Any:
        """Send one API call, retrying network errors and 5xx/429 with backoff.

        A POST is retried only when ``idempotent`` (it then carries an Idempotency-Key,
        the same on every attempt) or when the endpoint is idempotent by design.
        ``retries`` overrides the client's count; ``deadline`` (a ``time.monotonic()``
        instant) keeps retrying until then however many tries that takes, with pauses of at
        most ``MAX_PAUSE_S`` — a worker's reports use their lease's end, so an outage of the
        web shorter than the lease costs nothing. ``content``: a body already encoded as JSON.
        """
        headers = dict(headers or {})
        if idempotent and method == "POST":
            headers.setdefault("Idempotency-Key", uuid.uuid4().hex)
        retryable = method in ("GET", "HEAD", "PUT", "DELETE") or idempotent
        if json is not None:
            # orjson: a 1000-point metric batch encodes ~10x faster than with the stdlib.
            content = orjson.dumps(json, option=orjson.OPT_NON_STR_KEYS)
        if content is not None:
            headers.setdefault("Content-Type", "application/json")
        budget = self.retries if retries is None else retries

        def may_retry(attempt: int) -> bool:
            if not retryable:
                return False
            if deadline is not None:
                return time.monotonic() < deadline
            return attempt <= budget

        def pause(attempt: int, hint: float | None = None) -> None:
            delay = hint if hint is not None else self.backoff * 2 ** min(attempt - 1, 10)
            delay = min(delay, 30.0)
            if deadline is not None:
                delay = max(0.0, min(delay, MAX_PAUSE_S, deadline - time.monotonic()))
            time.sleep(delay)

        attempt = 0
        while True:
            attempt += 1
            for part in (files or {}).values():  # a retried upload sends its file again
                if isinstance(part, tuple) and hasattr(part[1], "seek"):
                    part[1].seek(0)
            try:
                response = self.http.request(method, f"/api/v1/{path.lstrip('/')}",
                                             content=content, params=params, headers=headers,
                                             files=files, data=data)
            except httpx.TransportError as exc:
                if not may_retry(attempt):
                    raise
                # An outage ridden out until a deadline retries every couple of seconds: a
                # line per try for the first few, then one a half minute.
                log.log(logging.WARNING if attempt <= 3 or attempt % 15 == 0 else
                        logging.DEBUG, "%s %s failed (%s); retry %d", method, path, exc,
                        attempt)
                pause(attempt)
                continue
            if response.status_code in RETRY_STATUSES and may_retry(attempt):
                after = response.headers.get("Retry-After")
                try:
                    hint = float(after) if after else None
                except ValueError:
                    hint = None
                pause(attempt, hint)
                continue
            return self._decode(response)

    @staticmethod
    def _decode(response: httpx.Response) -> Any:
        if response.status_code == 204:
            return None
        try:
            # orjson: a 100-series metrics read (600k numbers) parses ~5x faster than stdlib.
            body = orjson.loads(response.content)
        except ValueError:
            body = response.text
        if response.status_code >= 400:
            code = body.get("code", "error") if isinstance(body, dict) else "error"
            message = body.get("message", str(body)) if isinstance(body, dict) else str(body)
            cls = LeaseLost if response.status_code == 409 and code in (
                "lease_invalid", "lease_expired", "run_not_active") else ApiError
            raise cls(response.status_code, code, message, body)
        return body

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params or None)

    def paginate(self, path: str, **params: Any) -> Iterator[dict[str, Any]]:
        """Follow cursor pagination to the end."""
        page = self.get(path, **params)
        while True:
            yield from page["results"]
            if not page.get("next"):
                return
            response = self.http.get(page["next"])
            page = self._decode(response)

    # --- for people and scripts ------------------------------------------------------
    def me(self) -> dict[str, Any]:
        return self.get("me")

    def create_team(self, slug: str, name: str = "") -> dict[str, Any]:
        return self.request("POST", "teams", json={"slug": slug, "name": name})

    def create_project(self, team: str, slug: str, name: str = "") -> dict[str, Any]:
        return self.request("POST", f"teams/{team}/projects", json={"slug": slug, "name": name})

    def create_dataset(self, team: str, slug: str, project: str, description: str = "") -> Any:
        return self.request("POST", f"teams/{team}/datasets",
                            json={"slug": slug, "project": project, "description": description})

    def upload_version(
        self,
        team: str,
        dataset: str,
        records: Iterable[dict[str, Any]],
        *,
        message: str = "",
        parents: list[str] | None = None,
    ) -> dict[str, Any]:
        return self.request(
            "POST", f"teams/{team}/datasets/{dataset}/versions", idempotent=True,
            json={"records": list(records), "message": message, "parents": parents or []},
        )

    def upload_file(
        self,
        team: str,
        dataset: str,
        path: str | os.PathLike[str],
        *,
        project: str | None = None,
        message: str = "",
        parents: list[str] | None = None,
        description: str = "",
    ) -> dict[str, Any]:
        """Upload a JSONL or Parquet file as a version of ``dataset`` in one call (the server
        reads Parquet by its magic bytes and streams either format). With ``project``, a
        dataset that does not exist yet is created there first. Returns the version (an
        identical upload returns the existing one)."""
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"no file {file}")
        if project is not None:
            try:
                self.get(f"teams/{team}/datasets/{dataset}")
            except ApiError as exc:
                if exc.status != 404:
                    raise
                try:
                    self.create_dataset(team, dataset, project, description)
                except ApiError as again:
                    if again.status != 409:  # created meanwhile by someone else: fine
                        raise
        kind = "application/vnd.apache.parquet" if file.suffix.lower() in (
            ".parquet", ".pq") else "application/x-ndjson"
        with file.open("rb") as handle:
            return self.request(
                "POST", f"teams/{team}/datasets/{dataset}/versions", idempotent=True,
                files={"file": (file.name, handle, kind)},
                data={"message": message, "parents": list(parents or [])})

    def launch_run(self, team: str, **document: Any) -> dict[str, Any]:
        return self.request("POST", f"teams/{team}/runs", json=document, idempotent=True)

    def preview(self, team: str, **document: Any) -> dict[str, Any]:
        """Validate and resolve a launch document, creating nothing. Returns the validation
        result rather than raising on it: ``{"valid": True, "run": {...}}``, or
        ``{"valid": False, "code", "message", "errors"}`` naming each bad field. Errors that
        are not about the document (401, 403, 404, 5xx) still raise ``ApiError``."""
        try:
            return self.request("POST", f"teams/{team}/runs/preview", json=document)
        except ApiError as exc:
            if exc.status != 400:
                raise
            body = exc.body if isinstance(exc.body, dict) else {}
            return {"valid": False, "code": exc.code, "message": exc.message,
                    "errors": body.get("errors") or {}}

    preview_run = preview

    def run(self, team: str, run_id: str) -> dict[str, Any]:
        return self.get(f"teams/{team}/runs/{run_id}")

    def cancel_run(self, team: str, run_id: str) -> dict[str, Any]:
        return self.request("POST", f"teams/{team}/runs/{run_id}/cancel")

    def run_events(self, team: str, run_id: str, after: int = 0) -> dict[str, Any]:
        return self.get(f"teams/{team}/runs/{run_id}/events", after=after)

    def run_metrics(self, team: str, run_id: str, names: list[str] | None = None,
                    max_points: int = 1000, *, after_step: int | None = None,
                    layout: str = "points") -> dict[str, Any]:
        """Series downsampled to ``max_points`` buckets; with ``after_step``, the raw points
        after that step instead (at most ``max_points`` per series, oldest first): poll
        cheaply by passing each series' ``last_step`` back (``more`` says others follow).
        ``layout="columns"``: each series as parallel arrays (``columns``: step, min, max,
        last, count, wall) instead of a list of ``points``, a third of the bytes."""
        params: dict[str, Any] = {"max_points": max_points}
        if layout != "points":
            params["layout"] = layout
        if names:
            params["name"] = names
        if after_step is not None:
            params["after_step"] = after_step
        return self.request("GET", f"teams/{team}/runs/{run_id}/metrics", params=params)

    def run_samples(self, team: str, run_id: str, *, step: int | None = None,
                    limit: int = 100) -> list[dict[str, Any]]:
        """The run's samples, newest first, or those of one ``step`` as generated: prompt,
        completion, reward, reward_components and, for RL, advantage, weight_version and
        finish_reason."""
        params: dict[str, Any] = {"limit": limit}
        if step is not None:
            params["step"] = step
        return self.request("GET", f"teams/{team}/runs/{run_id}/samples",
                            params=params)["results"]

    def compare_runs(self, team: str, run_ids: list[str], *, names: list[str] | None = None,
                     max_points: int = 300, all_keys: bool = False) -> dict[str, Any]:
        """What the compare page shows, for 1-10 runs: ``metrics.series`` (per metric, each
        run's downsampled points), ``config`` (flattened keys that differ, or all with
        ``all_keys``) and ``reports`` (numeric leaves side by side, regressions marked)."""
        params: dict[str, Any] = {"run": list(run_ids), "max_points": max_points}
        if names:
            params["name"] = names
        if all_keys:
            params["all"] = "1"
        return self.request("GET", f"teams/{team}/runs/compare", params=params)

    def stream(self, team: str, run_id: str, *, after: int = 0, until_done: bool = True,
               timeout: float | None = None, reconnects: int = 5) -> Iterator[dict[str, Any]]:
        """The run's live stream over the websocket: events (status changes included) and
        metric batches, in ``seq`` order from ``after + 1`` — what was missed first, then the
        live tail. A dropped connection is reopened with ``?after=<last seq>``, so nothing
        is lost or seen twice (``reconnects`` failures in a row give up). With
        ``until_done`` the iterator ends after the run's final status; ``timeout`` (seconds
        without a message) raises TimeoutError."""
        from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
        from websockets.sync.client import connect

        ws = "ws" + self.base_url[len("http"):] if self.base_url.startswith("http") else \
            self.base_url
        headers = {k: v for k, v in self.http.headers.items() if k.lower() == "authorization"}
        last, failures = after, 0
        while True:
            url = f"{ws}/ws/teams/{team}/runs/{run_id}/stream?after={last}"
            try:
                with connect(url, additional_headers=headers, open_timeout=30) as conn:
                    while True:
                        message = orjson.loads(conn.recv(timeout=timeout))
                        failures = 0
                        seq = message.get("seq") if isinstance(message, dict) else None
                        if not isinstance(seq, int) or seq <= last:
                            continue  # a pong, or a position already seen
                        last = seq
                        yield message
                        if until_done and self._finished(team, run_id, message):
                            return
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd is not None else None
                if code == 4404:
                    raise ApiError(404, "not_found", f"No run '{run_id}' in team '{team}' "
                                   "(or no access to it).") from exc
                failure: Exception = exc
            except InvalidStatus as exc:
                if exc.response.status_code in (401, 403, 404):
                    # The consumer refuses a non-member exactly as a missing run.
                    raise ApiError(404, "not_found", f"No run '{run_id}' in team '{team}' (or "
                                   "no access to it).") from exc
                failure = exc
            except (OSError, InvalidHandshake) as exc:
                failure = exc
            failures += 1
            if failures > reconnects:
                raise failure
            log.warning("stream of run %s dropped (%s); reconnecting after seq %d", run_id,
                        failure, last)
            time.sleep(min(self.backoff * 2 ** (failures - 1), 10.0))

    def _finished(self, team: str, run_id: str, message: dict[str, Any]) -> bool:
        """A final status event, confirmed by the run itself: a failed attempt that is
        retried reports failed, then queued."""
        data = message.get("data")
        if not isinstance(data, dict):
            data = {}
        if message.get("type") != "event" or message.get("kind") != "status" or \
                data.get("status") not in FINAL_STATUSES:
            return False
        return self.run(team, run_id)["status"] in FINAL_STATUSES

    def run_report(self, team: str, run_id: str) -> dict[str, Any]:
        return self.get(f"teams/{team}/runs/{run_id}/report")

    def run_checkpoints(self, team: str, run_id: str) -> list[dict[str, Any]]:
        return self.get(f"teams/{team}/runs/{run_id}/checkpoints")["results"]

    def resume_run(self, team: str, run_id: str) -> dict[str, Any]:
        return self.request("POST", f"teams/{team}/runs/{run_id}/resume")

    def lineage(self, team: str, artifact: str) -> dict[str, Any]:
        """The graph around ``artifact`` (``run:<id>``, ``checkpoint:<id>``,
        ``dataset_version:<digest>``, ``environment_version:<digest>``)."""
        return self.get(f"teams/{team}/lineage", artifact=artifact)

    def wait_for_run(self, team: str, run_id: str, *, timeout: float = 300,
                     poll: float = 0.5) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            run = self.run(team, run_id)
            if run["status"] in FINAL_STATUSES:
                return run
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id} still {run['status']} after {timeout}s")
            time.sleep(poll)

    # --- for workers -----------------------------------------------------------------
    def claim(self, pool: str, worker_id: str, run_id: str | None = None,
              node: str | None = None) -> WorkerSession | None:
        """Claim a run; ``node`` says which node this worker runs on (with the scheduler on,
        only a node the run's allocation names may claim it)."""
        request: dict[str, Any] = {"pool": pool, "worker_id": worker_id, "run_id": run_id}
        if node is not None:
            request["node"] = node
        body = self.request("POST", "worker/claim", json=request)
        if body is None:
            return None
        return WorkerSession(self, ClaimedRun.model_validate(body), worker_id)

    def start_execution(self, execution_id: str, worker_id: str) -> dict[str, Any]:
        """Claim one sandboxed execution (its request, for the sandbox engine)."""
        return self.request("POST", f"worker/executions/{execution_id}/start",
                            headers={"X-Crucible-Worker": worker_id})

    def finish_execution(self, execution_id: str, worker_id: str, body: dict[str, Any],
                         lease_id: str) -> Any:
        """Report an execution's ``{"result"}`` or ``{"error"}`` under the lease its start
        handed out (retried: idempotent)."""
        return self.request("POST", f"worker/executions/{execution_id}/result", json=body,
                            headers={"X-Crucible-Worker": worker_id,
                                     "X-Crucible-Lease": lease_id}, idempotent=True)

    def sweep(self) -> list[str]:
        """Requeue runs whose lease expired (operator tokens); returns the requeued ids."""
        return self.request("POST", "worker/sweep")["requeued"]

    def prune_metrics(self) -> dict[str, int]:
        """Drop raw metric points past each team's retention (operator tokens); returns
        {team: points dropped}."""
        return dict(self.request("POST", "worker/metrics/prune")["dropped"])

    def evaluate_alerts(self) -> dict[str, Any]:
        """Evaluate the periodic alert rules (queue wait, lost nodes) and resend stalled
        webhook deliveries (operator tokens)."""
        return dict(self.request("POST", "worker/alerts/evaluate"))

    def attempt_delivery(self, delivery_id: int) -> dict[str, Any]:
        """Make a webhook delivery's next attempt if due (operator tokens): ``{"status",
        "attempted", "retry_in"}``."""
        return dict(self.request("POST", f"worker/alerts/deliveries/{int(delivery_id)}/attempt"))

    def admission_pass(self) -> dict[str, Any]:
        """Run one admission pass (operator tokens): what it admitted, preempted, and left
        waiting; ``{"leader": false}`` when another pass held the lock."""
        return dict(self.request("POST", "worker/admission"))

    # --- for node agents (operator tokens) -----------------------------------------------
    def register_node(self, registration: NodeRegistration) -> NodeStatus:
        """Create or update this host's node (retried: registering is idempotent by name)."""
        body = self.request("POST", "worker/nodes/register", json=registration.model_dump(),
                            idempotent=True)
        return NodeStatus.model_validate(body)

    def node_heartbeat(self, name: str, heartbeat: NodeHeartbeat | None = None) -> NodeStatus:
        """One sign of life; the answer says whether the node takes work (``lost``: register
        again). Not retried: the next beat is the retry."""
        body = self.request("POST", f"worker/nodes/{name}/heartbeat",
                            json=(heartbeat or NodeHeartbeat()).model_dump())
        return NodeStatus.model_validate(body)


    def report_dead_leases(self, name: str, report: DeadLeaseReport) -> dict[str, Any]:
        """The leases of worker processes found dead on node ``name``: their runs are
        requeued at once (retried: releasing a lease twice is a no-op)."""
        return dict(self.request("POST", f"worker/nodes/{name}/dead-leases",
                                 json=report.model_dump(), idempotent=True))


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def node_name(env: Mapping[str, str] | None = None) -> str:
    """This host's node name: ``CRUCIBLE_NODE_NAME``, else the host name. The node agent
    registers under it and the host's workers claim under it, so both must read it here."""
    env = os.environ if env is None else env
    return env.get("CRUCIBLE_NODE_NAME", "").strip() or socket.gethostname()


def metric_columns(points: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Points as the columnar batch body (``name``, ``step``, ``value``, ``wall_time``):
    the server checks a column at a time instead of an object per point. Points without a
    ``wall_time`` take the time of this call when others in the batch have one."""
    columns: dict[str, list[Any]] = {"name": [p["name"] for p in points],
                                     "step": [p["step"] for p in points],
                                     "value": [p["value"] for p in points]}
    with_wall = sum(1 for p in points if "wall_time" in p)
    if with_wall:
        now = time.time()
        columns["wall_time"] = [p["wall_time"] for p in points] if with_wall == len(points) \
            else [p.get("wall_time", now) for p in points]
    return columns


@dataclass
class WorkerSession:
    """One claimed run: every call carries the lease; a heartbeat thread keeps it alive.

    A retried attempt replays the steps after its last checkpoint. Its metric batches
    continue the run's batch numbering (``metric_seq`` from the claim), and a point at a
    step at or below the last step earlier attempts stored for its series
    (``metric_steps`` from the claim) is dropped: the first stored value of a replayed
    (name, step) stands, so a replay never stores a point twice. A first attempt has no
    such steps and sends every point as given.

    Control-plane outages up to the lease are ridden out (why: a 20 s web or database
    restart used to fail the attempt and retrain from the last checkpoint). Metrics, events
    and samples the API does not take within a few quick tries go to an
    :class:`~workers.outbox.Outbox` (memory, then disk) and the engine trains on; the
    outbox sends them in order when the API answers again. Heartbeats retry every couple of
    seconds, and status changes, checkpoints and reports (which first wait for the outbox to
    empty, so they never overtake what it holds) retry, until the lease would have expired
    (``lease_deadline``: the last renewal plus the lease's length). Past it the lease is
    taken as lost (``lease_lost``): another worker may own the run by then.
    """

    client: CrucibleClient
    run: ClaimedRun
    worker_id: str

    def __post_init__(self) -> None:
        self.run_id: str = self.run.id
        self.lease_id: str = self.run.lease_id
        self._metric_seq: int = self.run.metric_seq
        self._replayed: dict[str, int] = dict(self.run.metric_steps)
        self.dropped_points = 0
        self.blocked_samples = 0  # refused by the team's output filter (not stored)
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._preempt = threading.Event()
        self._thread: threading.Thread | None = None
        self.lease_s = DEFAULT_LEASE_S
        if self.run.lease_expires_at:
            left = datetime.fromisoformat(self.run.lease_expires_at) - datetime.now(UTC)
            self.lease_s = max(1.0, left.total_seconds())
        self._renewed = time.monotonic()
        self._outbox: Outbox | None = None
        self._outbox_lock = threading.Lock()

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Crucible-Lease": self.lease_id, "X-Crucible-Worker": self.worker_id}

    @property
    def lease_deadline(self) -> float:
        """When (``time.monotonic()``) the lease runs out unless a heartbeat renews it."""
        return self._renewed + self.lease_s

    def _retry_until(self) -> float:
        """How long a report keeps trying: to the lease's end, and never less than the
        client's old budget (a session without heartbeats, or a very short lease)."""
        return max(self.lease_deadline, time.monotonic() + MIN_RETRY_S)

    def _post(self, what: str, body: Any, *, idempotent: bool = False,
              deadline: float | None = None) -> Any:
        return self.client.request("POST", f"worker/runs/{self.run_id}/{what}", json=body,
                                   headers=self.headers, idempotent=idempotent,
                                   deadline=deadline)

    def _barrier(self, what: str, body: Any) -> Any:
        """A report that must not overtake the outbox (status, checkpoint, report): wait for
        the outbox to empty, then send, retrying until the lease deadline."""
        self.flush()
        return self._post(what, body, idempotent=True, deadline=self._retry_until())

    # --- the outbox ----------------------------------------------------------------------
    @property
    def outbox(self) -> Outbox:
        with self._outbox_lock:
            if self._outbox is None:
                spool = var_dir() / "outbox" / f"{self.run_id}-{os.getpid()}-{id(self):x}"
                self._outbox = Outbox(self._deliver, spool, name=f"outbox-{self.run_id}")
            return self._outbox

    @property
    def buffering(self) -> bool:
        """Whether reports are waiting in the outbox (the API was unreachable)."""
        return self._outbox is not None and self._outbox.pending()

    def _deliver(self, item: Item) -> None:
        """Send one outbox item until the lease deadline. A 4xx other than a lost lease
        drops the item (the API refused it; retrying cannot help) with a log line; a lost
        lease or the deadline stops the outbox."""
        try:
            self.client.request("POST", item.path, content=item.content(),
                                headers=item.headers, idempotent=True,
                                deadline=self._retry_until())
        except LeaseLost:
            self._lost.set()
            raise
        except ApiError as exc:
            if exc.status in RETRY_STATUSES:
                self._lost.set()  # still failing at the lease's end
                raise
            refused = blocked_rows(exc)
            if refused is not None and item.path.endswith("/samples"):
                samples = orjson.loads(item.content())["samples"]
                rest = self._drop_blocked(samples, refused)
                if rest:
                    headers = {**item.headers, "Idempotency-Key": uuid.uuid4().hex}
                    content = orjson.dumps({"samples": rest})
                    self._deliver(Item(item.path, headers, len(content), body=content))
                return
            log.error("run %s: the API refused a queued report to %s: %s", self.run_id,
                      item.path, exc)
        except httpx.TransportError:
            log.error("run %s: the API stayed unreachable until the lease ran out",
                      self.run_id)
            self._lost.set()
            raise

    def _report(self, what: str, body: dict[str, Any], *, quiet: bool = False,
                msgpack_body: bool = False) -> Any:
        """Send a metric batch, event or sample batch now; when the API does not take it
        within a few quick tries (or reports are already queued: order), queue it."""
        if self._lost.is_set():
            raise LeaseLost(409, "lease_invalid", f"the lease on run {self.run_id} is lost")
        path = f"worker/runs/{self.run_id}/{what}"
        headers = {**self.headers, "Idempotency-Key": uuid.uuid4().hex}
        if msgpack_body:
            headers["Content-Type"] = "application/msgpack"
            content = msgpack.packb(body)
        else:
            content = orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)
        if not self.buffering:
            try:
                return self.client.request("POST", path, content=content, headers=headers,
                                           idempotent=True, retries=QUICK_RETRIES)
            except ApiError as exc:  # LeaseLost among them: the caller's to handle
                if exc.status not in RETRY_STATUSES:
                    raise
                reason: Exception = exc
            except httpx.TransportError as exc:
                reason = exc
            if not quiet:
                log.warning("run %s: the API is unreachable (%s); queueing reports and "
                            "training on", self.run_id, reason)
        self.outbox.put(path, content, headers)
        return {"buffered": True}

    def flush(self, deadline: float | None = None) -> None:
        """Wait until the outbox is empty (by default until the lease deadline); raise
        LeaseLost when it stopped because the lease ran out or was lost."""
        if self._outbox is None:
            return
        # The lease's end is looked at again each second: heartbeats move it on while a long
        # backlog drains (10M points with the web restarted mid-way left a writer's outbox
        # minutes long; a deadline fixed at the start gave up on a lease still alive).
        while self._outbox.pending() and self._outbox.error is None \
                and not self._lost.is_set() \
                and time.monotonic() < (deadline if deadline is not None
                                        else self._retry_until()):
            self._outbox.wait_empty(timeout=1.0)
        if self._outbox.pending() or self._outbox.error is not None:
            raise LeaseLost(409, "lease_invalid", f"reports of run {self.run_id} could not be "
                            f"delivered before its lease ran out ({self._outbox.error})")

    # --- the lease -----------------------------------------------------------------------
    @property
    def lease_lost(self) -> bool:
        return self._lost.is_set()

    def start_heartbeat(self, interval: float | None = None) -> None:
        """Beat in the background, by default three times per lease period; after a failed
        beat, again every ``HEARTBEAT_RETRY_S`` until one succeeds or the lease has run out
        (then the lease is taken as lost)."""
        if interval is None:
            interval = max(0.5, min(30.0, self.lease_s / 3))
        beat_every: float = interval

        def beat() -> None:
            wait = beat_every
            while not self._stop.wait(wait):
                try:
                    self.heartbeat(retries=1)
                    wait = beat_every
                except LeaseLost:
                    self._lost.set()
                    return
                except Exception as exc:  # the web or its database is down: retry soon
                    if time.monotonic() >= self.lease_deadline:
                        log.error("run %s: no heartbeat got through for the whole lease "
                                  "(%.0f s); giving the run up", self.run_id, self.lease_s)
                        self._lost.set()
                        return
                    log.warning("heartbeat for %s failed (%s); retrying", self.run_id, exc)
                    wait = min(HEARTBEAT_RETRY_S, beat_every)

        self._thread = threading.Thread(target=beat, name=f"heartbeat-{self.run_id}",
                                        daemon=True)
        self._thread.start()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def close(self) -> None:
        """Deliver what the outbox holds (until the lease deadline), then stop beating."""
        try:
            if self._outbox is not None and not self._lost.is_set():
                with contextlib.suppress(LeaseLost):
                    self.flush()
        finally:
            if self._outbox is not None:
                self._outbox.close()
            self.stop_heartbeat()

    def heartbeat(self, *, retries: int | None = None) -> dict[str, Any]:
        """Renew the lease; an answer with ``stop: preempt`` (the scheduler needs the run's
        GPUs) makes ``should_stop`` true, so the engine stops at its next safe point."""
        sent = time.monotonic()
        body = self.client.request("POST", f"worker/runs/{self.run_id}/heartbeat",
                                   headers=self.headers,
                                   idempotent=retries is not None, retries=retries)
        self._renewed = sent
        if isinstance(body, dict) and body.get("stop") == "preempt":
            self._preempt.set()
        return body

    @property
    def preempt_requested(self) -> bool:
        return self._preempt.is_set()

    @property
    def drain_requested(self) -> bool:
        """This worker process is shutting down (SIGTERM; :mod:`workers.drain`)."""
        return drain.requested()

    @property
    def should_stop(self) -> bool:
        """The run was canceled, the lease moved on, the scheduler asked it to make room, or
        the worker is shutting down: stop at the next safe point."""
        return self._lost.is_set() or self._preempt.is_set() or drain.requested()

    def attempt_started(self, resume_step: int = 0) -> Any:
        """The attempt's startup is over and its work begins from checkpoint ``resume_step``
        (the web stamps the time; goodput tells startup from work by it)."""
        return self._barrier("started", {"resume_step": resume_step})

    def set_status(self, status: str, error: str = "", *, retry: bool = False,
                   drained: bool = False, **classified: Any) -> dict[str, Any]:
        """Sent after everything queued, retried until the lease deadline; if an earlier try
        was applied but its answer lost, the server's 409 "already <status>" counts as done.
        ``classified``: the failure's ``cause``, ``node`` and ``toolchains``
        (protocol.StatusChange)."""
        body: dict[str, Any] = {"status": status, "error": error, **classified}
        if retry:
            body["retry"] = True
        if drained:
            body["drained"] = True
        try:
            return self._barrier("status", body)
        except ApiError as exc:
            details = exc.body.get("errors") if isinstance(exc.body, dict) else None
            if exc.code == "illegal_transition" and isinstance(details, dict) \
                    and details.get("status") == status:
                return {"status": status}
            raise

    def log_metrics(self, points: list[dict[str, Any]], seq: int | None = None) -> dict[str, Any]:
        """Points are ``{"name", "step", "value", "wall_time"?}``; ``seq`` numbers batches.
        Points a replay would store twice are dropped (see the class docstring). While the
        API is unreachable the batch is queued (``{"buffered": True}``)."""
        fresh = points
        if self._replayed:
            fresh = [p for p in points if p["step"] > self._replayed.get(p["name"], -1)]
            self.dropped_points += len(points) - len(fresh)
            if not fresh:
                return {"stored": 0, "duplicate": False, "dropped": len(points)}
        if seq is None:
            self._metric_seq += 1
            seq = self._metric_seq
        # Safe to retry: the server stores each (run, seq) once.
        encoding = self.client.metric_encoding
        if encoding == "json-rows":
            return self._report("metrics", {"seq": seq, "points": fresh})
        return self._report("metrics", {"seq": seq, "columns": metric_columns(fresh)},
                            msgpack_body=encoding == "msgpack")

    def log_event(self, message: str, level: str = "info", kind: str = "log",
                  data: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._report("events", {"events": [
            {"message": message, "level": level, "kind": kind, "data": data or {}}
        ]})

    def add_checkpoint(self, step: int, uri: str, metrics: dict[str, Any] | None = None, *,
                       resumable: bool = False, keep: int | None = None) -> Any:
        """Record a checkpoint object. ``resumable``: it holds the training state a resume
        needs; ``keep``: then prune the run's resumable checkpoints in the store to the newest
        ``keep`` (the server keeps any that lineage points to). It carries the claim's lease
        epoch, which the server refuses once a later claim has moved it on."""
        body: dict[str, Any] = {"step": step, "uri": uri, "metrics": metrics or {},
                                "resumable": resumable}
        if self.run.lease_epoch:
            body["lease_epoch"] = self.run.lease_epoch
        if keep is not None:
            body["keep"] = keep
        return self._barrier("checkpoints", body)

    def add_samples(self, samples: list[dict[str, Any]]) -> Any:
        """Send a sample batch. Rows the team's output filter blocks (422
        ``output_blocked``, naming them) are left out and counted in ``blocked_samples``;
        the rest go again as a new batch (the server stores nothing of a refused batch)."""
        try:
            return self._report("samples", {"samples": samples})
        except ApiError as exc:
            refused = blocked_rows(exc)
            if refused is None:
                raise
        rest = self._drop_blocked(samples, refused)
        if not rest:
            return {"stored": 0, "blocked": len(refused)}
        return self.add_samples(rest)

    def _drop_blocked(self, samples: list[dict[str, Any]], refused: set[int]
                      ) -> list[dict[str, Any]]:
        self.blocked_samples += len(refused)
        log.warning("run %s: the output filter blocked %d of %d samples (%d so far); sending "
                    "the rest", self.run_id, len(refused), len(samples), self.blocked_samples)
        return [s for i, s in enumerate(samples) if i not in refused]

    def set_report(self, uri: str) -> Any:
        return self._barrier("artifacts", {"kind": "report", "uri": uri})

    def report_qc(self, report: dict[str, Any], uri: str) -> dict[str, Any]:
        """A QC run's result (:class:`workers.protocol.QcReport`); the answer says the
        version's QC status."""
        return self._barrier("qc", {"report": report, "uri": uri})

    def hand_over_batch(self, batch: BatchHandOver) -> dict[str, Any]:
        """A synthesize run's records, to review as a batch of ``batch.dataset``."""
        return self._barrier("batches", batch.model_dump(mode="json"))
