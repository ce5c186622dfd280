"""The node agent: one per host (``python -m workers.agent``). It tells the control plane
what this host offers — pool, GPU type and count, CPUs, memory, labels — then heartbeats,
so the scheduler knows which capacity is alive. It holds no database credentials and no
Django: it speaks the worker API with an operator worker token, like the pools.

Environment:

- ``CRUCIBLE_API_URL``, ``CRUCIBLE_WORKER_TOKEN`` (an operator token, not tied to a team)
- ``CRUCIBLE_NODE_NAME`` (default: the host name), ``CRUCIBLE_NODE_POOL`` (default ``gpu``
  when the host has GPUs, else ``cpu``)
- ``CRUCIBLE_NODE_LABELS``: ``key=value,key=value`` (e.g. ``zone=a,ib=true``)
- ``CRUCIBLE_NODE_HEARTBEAT_S``: seconds between heartbeats (default 10)
- ``CRUCIBLE_NODE_PROBE``: sandbox languages to health-probe at start and every
  ``CRUCIBLE_NODE_PROBE_S`` seconds (default ``python``, and 300 s; ``none`` probes nothing
  until asked), reported in the heartbeat; when a heartbeat's answer asks for a ``recheck``
  (a run's environment failed on this node), the agent clears the sandbox's cached state,
  probes those languages again and reports them in its next beat
- ``CRUCIBLE_FAKE_GPUS=N`` and ``CRUCIBLE_GPU_TYPE``: pretend to have N GPUs of that type
  (tests, development); without them ``nvidia-smi`` is asked when it is installed.
  ``CRUCIBLE_GPU_TYPE`` also overrides the type ``nvidia-smi`` reports.

- ``CRUCIBLE_NODE_WATCH_S``: how often the agent looks for dead worker processes (default 1)
- ``CRUCIBLE_AGENT_WORKER``: a command (split like a shell line, no shell) for the host's
  Celery worker, which the agent then starts and restarts whenever it exits (backoff from 1 s
  to 30 s), e.g. ``celery -A config.celery worker -Q gpu,node.$HOST -c 1``. Unset: the agent
  supervises nothing (a process manager, or ``manage.py up``, runs the workers).

Two things it does for the host's workers, because it is the one long-lived process there:

- **Dead workers are reported at once.** Each worker process that holds a run's lease writes
  a lease file under ``<var>/leases`` (``workers.liveness``); every ``CRUCIBLE_NODE_WATCH_S``
  the agent checks those processes and reports the leases of dead ones
  (``POST /api/v1/worker/nodes/<name>/dead-leases``), so their runs are requeued within
  seconds of a SIGKILL instead of when the lease expires.
- **A worker that exits is restarted** when ``CRUCIBLE_AGENT_WORKER`` is set: a Redis outage
  makes a busy Celery 5.7 worker exit after its task (kombu's ``restore_unacked`` bug), and
  nothing else would bring it back.

SIGTERM or SIGINT stops it between heartbeats (and the supervised worker, with SIGTERM: a
warm shutdown); it exits 0.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping
from importlib import metadata
from types import FrameType
from typing import NamedTuple

from pydantic import ValidationError

from workers import liveness
from workers.client import ApiError, CrucibleClient, node_name
from workers.protocol import (
    DeadLease,
    DeadLeaseReport,
    NodeHeartbeat,
    NodeRegistration,
    NodeStatus,
    ToolchainHealth,
)
from workers.supervise import Child, Supervisor

log = logging.getLogger("crucible.agent")

DEFAULT_HEARTBEAT_S = 10.0
DEFAULT_PROBE_S = 300.0
DEFAULT_WATCH_S = 1.0
NVIDIA_SMI_TIMEOUT_S = 20


def agent_version() -> str:
    try:
        return metadata.version("crucible")
    except metadata.PackageNotFoundError:
        return "dev"


class Gpus(NamedTuple):
    total: int
    model: str


def parse_nvidia_smi(output: str) -> Gpus:
    """``nvidia-smi --query-gpu=name --format=csv,noheader`` output -> count and type. A host
    with mixed GPUs reports its most common type (a node is one flavor to the scheduler)."""
    names = [line.strip() for line in output.splitlines() if line.strip()]
    if not names:
        return Gpus(0, "")
    (most, _), *others = Counter(names).most_common()
    if others:
        log.warning("mixed GPU types on this host %s: registering all as %s",
                    sorted(set(names)), most)
    return Gpus(len(names), most)


def detect_gpus(env: Mapping[str, str]) -> Gpus:
    override = env.get("CRUCIBLE_GPU_TYPE", "").strip()
    fake = env.get("CRUCIBLE_FAKE_GPUS", "").strip()
    if fake:
        try:
            count = int(fake)
        except ValueError as exc:
            raise SystemExit(f"CRUCIBLE_FAKE_GPUS must be a whole number, not {fake!r}") \
                from exc
        if count < 0:
            raise SystemExit(f"CRUCIBLE_FAKE_GPUS must be 0 or more, not {count}")
        return Gpus(count, (override or "fake") if count else "")
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return Gpus(0, "")
    try:
        done = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S,
                              check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi failed (%s): registering no GPUs", exc)
        return Gpus(0, "")
    found = parse_nvidia_smi(done.stdout)
    return Gpus(found.total, override or found.model) if found.total else found


def detect_cpus() -> int:
    """CPUs this process may run on (a container's cpuset, not the host's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def detect_memory_mb() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20)
    except (ValueError, OSError, AttributeError):
        return 0


def parse_labels(raw: str) -> dict[str, str]:
    """``"zone=a, ib=true"`` -> ``{"zone": "a", "ib": "true"}``; a bare key means ``"true"``."""
    labels: dict[str, str] = {}
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        labels[key.strip()] = value.strip() if sep else "true"
    return labels


def describe_host(env: Mapping[str, str]) -> NodeRegistration:
    """This host as a registration document (validated here, so a bad variable fails at
    start with pydantic's message instead of as a 400 from the web)."""
    gpus = detect_gpus(env)
    pool = env.get("CRUCIBLE_NODE_POOL", "").strip() or ("gpu" if gpus.total else "cpu")
    return NodeRegistration.model_validate({
        "name": node_name(env),
        "pool": pool, "gpu_type": gpus.model, "gpu_count": gpus.total,
        "cpus": detect_cpus(), "memory_mb": detect_memory_mb(),
        "labels": parse_labels(env.get("CRUCIBLE_NODE_LABELS", "")),
        "agent_version": agent_version(),
    })


def seconds(env: Mapping[str, str], name: str, default: float, *,
            strict: bool = True) -> float:
    """The variable ``name`` as a positive number of seconds (``default`` when unset). A bad
    value stops the agent with a message naming it; a value <= 0 does too when ``strict``, else
    it means the default."""
    raw = env.get(name, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError as exc:
        raise SystemExit(f"{name} must be a number of seconds, not {raw!r}") from exc
    if value <= 0:
        if strict:
            raise SystemExit(f"{name} must be positive, not {raw!r}")
        return default
    return value


def heartbeat_interval(env: Mapping[str, str]) -> float:
    return seconds(env, "CRUCIBLE_NODE_HEARTBEAT_S", DEFAULT_HEARTBEAT_S)


def watch_interval(env: Mapping[str, str]) -> float:
    return seconds(env, "CRUCIBLE_NODE_WATCH_S", DEFAULT_WATCH_S, strict=False)


def supervised_worker(env: Mapping[str, str]) -> Child | None:
    """The host's Celery worker the agent keeps running (``CRUCIBLE_AGENT_WORKER``), or None."""
    raw = env.get("CRUCIBLE_AGENT_WORKER", "").strip()
    if not raw:
        return None
    command = shlex.split(raw)
    if command[0] in ("celery", "python", "python3"):
        # This interpreter, so the worker runs in the agent's environment (its venv).
        command = [sys.executable, *(["-m", "celery"] if command[0] == "celery" else []),
                   *command[1:]]
    return Child("worker", command)


def probe_languages(env: Mapping[str, str]) -> tuple[str, ...]:
    raw = env.get("CRUCIBLE_NODE_PROBE", "python").strip()
    if raw.lower() in ("", "none", "off"):
        return ()
    return tuple(sorted({part.strip() for part in raw.split(",") if part.strip()}))


def probe_interval(env: Mapping[str, str]) -> float:
    return seconds(env, "CRUCIBLE_NODE_PROBE_S", DEFAULT_PROBE_S, strict=False)


def probe_toolchains(languages: list[str], *, rebuild: bool) -> dict[str, ToolchainHealth]:
    """Probe the sandbox for ``languages`` (after clearing its cached state when asked to
    rebuild): what the next heartbeat reports."""
    from workers.sandbox import health  # the sandbox engine: only agents that probe

    if rebuild:
        health.rebuild()
    found = health.probe(languages)
    for check in found.values():
        if not check.ok:
            log.warning("sandbox probe failed: %s", check.detail)
    return {name: ToolchainHealth(ok=c.ok, detail=c.detail) for name, c in found.items()}


class Agent:
    """Register, then heartbeat until stopped; register again whenever the web answers that
    the node is lost or unknown (the web restarted on a fresh database, or the sweep gave up
    on this host during a network partition)."""

    def __init__(self, client: CrucibleClient, registration: NodeRegistration,
                 interval: float, probe: tuple[str, ...] = (),
                 probe_every: float = DEFAULT_PROBE_S, *, watch_every: float = DEFAULT_WATCH_S,
                 supervisor: Supervisor | None = None) -> None:
        self.client, self.registration, self.interval = client, registration, interval
        self.watch_every = watch_every
        self.supervisor = supervisor
        self.stop = threading.Event()
        self.state: str | None = None
        self.registered = False
        self.probe, self.probe_every = set(probe), probe_every
        self.next_probe = 0.0  # monotonic time of the next periodic probe: at once
        self.found: dict[str, ToolchainHealth] = {}  # probed, not yet reported

    def _probe_if_due(self, recheck: list[str]) -> None:
        """Probe what the web asked to re-check (rebuilding first), and periodically what
        this agent watches; the findings go with the next heartbeat."""
        if recheck:
            self.probe |= set(recheck)
            self.found.update(probe_toolchains(sorted(recheck), rebuild=True))
        if self.probe and time.monotonic() >= self.next_probe:
            self.found.update(probe_toolchains(sorted(self.probe), rebuild=False))
            self.next_probe = time.monotonic() + self.probe_every

    def _observe(self, status: NodeStatus) -> None:
        if status.state != self.state:
            reason = f" ({status.state_reason})" if status.state_reason else ""
            if self.state is None:
                log.info("node %s is %s%s", status.name, status.state, reason)
            else:
                log.info("node %s: %s -> %s%s", status.name, self.state, status.state, reason)
            self.state = status.state

    def _register(self) -> None:
        status = self.client.register_node(self.registration)
        if not self.registered:
            r = self.registration
            gpus = f"{r.gpu_count} x {r.gpu_type} GPU" if r.gpu_count else "no GPUs"
            log.info("registered node %s: pool %s, %s, %d CPUs, %d MiB", r.name, r.pool, gpus,
                     r.cpus, r.memory_mb)
        self.registered = True
        self._observe(status)

    def beat_once(self) -> None:
        """One step of the loop: register if not yet (or again), else heartbeat."""
        if not self.registered:
            self._register()
            return
        self._probe_if_due([])
        try:
            status = self.client.node_heartbeat(
                self.registration.name,
                NodeHeartbeat(agent_version=self.registration.agent_version,
                              toolchains=self.found))
        except ApiError as exc:
            if exc.status != 404:
                raise
            log.warning("the web does not know node %s: registering again",
                        self.registration.name)
            self.registered = False
            self._register()
            return
        self.found = {}
        self._observe(status)
        if status.state == "lost":
            self.registered = False
            self._register()
            return
        self._probe_if_due(status.recheck)

    def check_leases(self) -> list[str]:
        """Report the leases of this host's dead worker processes; a lease file is removed
        once the web has answered for it (released, or already moved on). Returns the runs
        released."""
        dead = liveness.dead_leases()
        if not dead:
            return []
        for held in dead:
            log.warning("worker %s (pid %d) died holding run %s: reporting it", held.worker_id,
                        held.pid, held.run_id)
        answer = self.client.report_dead_leases(self.registration.name, DeadLeaseReport(
            leases=[DeadLease(run=h.run_id, lease_id=h.lease_id, worker=h.worker_id, pid=h.pid)
                    for h in dead[:100]]))
        for held in dead[:100]:
            held.path.unlink(missing_ok=True)
        released = [str(r) for r in answer.get("released", [])]
        if released:
            log.info("requeued the runs of dead workers: %s", ", ".join(released))
        return released

    def _beat(self) -> None:
        try:
            self.beat_once()
        except ApiError as exc:
            if exc.status in (401, 403):  # a wrong token does not fix itself
                raise SystemExit(f"the web refused this agent: {exc.message}") from exc
            log.warning("node %s: %s", self.registration.name, exc)
        except Exception as exc:  # the web is down or unreachable: the next beat retries
            log.warning("node %s: cannot reach %s (%s)", self.registration.name,
                        self.client.base_url, exc)

    def _watch(self) -> None:
        if self.supervisor is not None:
            self.supervisor.poll()
        try:
            self.check_leases()
        except Exception as exc:  # the web is down: the files stay, the next look retries
            log.warning("node %s: cannot report dead workers yet (%s)",
                        self.registration.name, exc)

    def run(self) -> None:
        """Heartbeat every ``interval``; between beats, every ``watch_every``, restart the
        supervised worker if it exited and report dead workers' leases."""
        if self.supervisor is not None:
            self.supervisor.start()
        next_beat = 0.0
        try:
            while not self.stop.is_set():
                if time.monotonic() >= next_beat:
                    self._beat()
                    next_beat = time.monotonic() + self.interval
                self._watch()
                self.stop.wait(max(0.05, min(self.watch_every,
                                             next_beat - time.monotonic())))
        finally:
            log.info("node agent %s stopping", self.registration.name)
            if self.supervisor is not None:
                self.supervisor.stop()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                                                   "%(message)s", stream=sys.stdout)
    # One line per heartbeat would drown the state changes this log is for.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    env = os.environ
    try:
        registration = describe_host(env)
    except ValidationError as exc:
        raise SystemExit(f"this host cannot be described as a node (check the CRUCIBLE_NODE_* "
                         f"variables): {exc}") from exc
    interval = heartbeat_interval(env)
    # Short retries inside one beat: the loop itself retries on the next beat.
    with CrucibleClient(retries=2, backoff=0.5, timeout=max(5.0, interval)) as client:
        worker = supervised_worker(env)
        supervisor = Supervisor([worker]) if worker is not None else None
        agent = Agent(client, registration, interval, probe=probe_languages(env),
                      probe_every=probe_interval(env), watch_every=watch_interval(env),
                      supervisor=supervisor)

        def stop(signum: int, frame: FrameType | None) -> None:
            agent.stop.set()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
