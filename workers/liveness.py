"""Leases held by this host's worker processes, as files the node agent watches.

Why: a worker killed outright (SIGKILL, the OOM killer, a segfault in a native library) sends
nothing, and its run used to wait for its lease to expire (120 s by default) before another
worker could take it. Each process that holds a run's lease writes one small file here, named
by its pid, and removes it when it lets the lease go; the node agent of the host
(``workers.agent``) checks every second or so that each file's process is still alive, and
reports the lease of a dead one (``POST /api/v1/worker/nodes/<name>/dead-leases``), so the
control plane requeues the run at once. The file carries the lease id, so the report can only
end that very lease (a run claimed again since is untouched), and the process's start time,
so a recycled pid is not mistaken for the dead worker.

Folder: ``<var>/leases`` (``CRUCIBLE_VAR_DIR``): the agent and the workers of a host must share
it, as they share the node name. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from workers.paths import var_dir
from workers.supervise import pid_alive

log = logging.getLogger(__name__)


def lease_dir() -> Path:
    folder = var_dir() / "leases"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22),
    or "" where there is no /proc: with the pid it names one process, never a recycled one."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        return fields[19].decode()
    except (OSError, IndexError):
        return ""


@dataclass(frozen=True)
class HeldLease:
    """What one worker process wrote: its pid and start time, and the lease it holds."""

    pid: int
    started: str
    run_id: str
    lease_id: str
    worker_id: str
    path: Path

    def process_dead(self) -> bool:
        if not pid_alive(self.pid):
            return True
        # Alive, but is it the same process? A recycled pid has another start time.
        return bool(self.started) and process_start(self.pid) not in ("", self.started)


@contextlib.contextmanager
def holding(run_id: str, lease_id: str, worker_id: str,
            folder: Path | None = None) -> Iterator[Path | None]:
    """Announce, for as long as the block runs, that this process holds ``lease_id`` on
    ``run_id``. Never fails the run: a read-only var dir only costs the fast detection."""
    pid = os.getpid()
    path: Path | None = None
    try:
        folder = folder or lease_dir()
        path = folder / f"{pid}-{run_id}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": pid, "started": process_start(pid), "run": run_id,
                                   "lease_id": lease_id, "worker": worker_id}))
        tmp.chmod(0o600)  # the lease id speaks for the run
        tmp.replace(path)
    except OSError as exc:
        log.warning("cannot announce the lease of run %s in %s: %s", run_id, folder, exc)
        path = None
    try:
        yield path
    finally:
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()


def held_leases(folder: Path | None = None) -> list[HeldLease]:
    """Every lease file in the folder (unreadable or half-written ones skipped)."""
    folder = folder or lease_dir()
    found = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            found.append(HeldLease(int(data["pid"]), str(data.get("started", "")),
                                   str(data["run"]), str(data["lease_id"]),
                                   str(data.get("worker", "")), path))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def dead_leases(folder: Path | None = None) -> list[HeldLease]:
    return [held for held in held_leases(folder) if held.process_dead()]
