"""Keep a host's long-lived processes up: restart one that exits, with backoff.

Why: Celery 5.7 + kombu 5.7 + redis-py 8.1 kill a *busy* worker when the Redis broker drops
(kombu's ``restore_unacked`` raises "'NoneType' object has no attribute 'hostname'" and the
worker exits once its task ends; kombu #582/#970, celery #10205). Nothing in Celery restarts
it, so runs launched afterwards stayed queued. ``manage.py up`` and the node agent
(``CRUCIBLE_AGENT_WORKER``) supervise their children with :class:`Supervisor`; in production a
process manager (systemd ``Restart=always``, Kubernetes' restart policy) does the same.

Standard library only: the agent and ``up`` both use it, and the engines' import rules apply.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from workers import drain

log = logging.getLogger("crucible.supervise")

BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
# A child that stayed up this long before exiting is restarted after the shortest delay:
# its exit was a fresh fault, not a crash loop.
STABLE_AFTER_S = 60.0


@dataclass
class Child:
    """One supervised command. ``critical``: its exit stops the supervisor instead of being
    restarted (``up``'s web server: without it nothing works and the user must see why)."""

    name: str
    command: Sequence[str]
    env: Mapping[str, str] | None = None
    cwd: str | Path | None = None
    log_path: Path | None = None
    critical: bool = False
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    delay: float = BACKOFF_START_S
    restart_at: float | None = None  # monotonic time of the pending restart
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        if self.log_path is not None and self._log is None:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives with the child
        # A session of its own: the child's own children (Celery's pool, its embedded beat)
        # share its process group, so what it leaves behind when it is killed can be found
        # and ended (a SIGKILLed worker's beat lived on, and a restarted worker added a
        # second one); and a Ctrl-C at the terminal reaches the supervisor, which stops the
        # children in order, instead of racing it.
        self.proc = subprocess.Popen(list(self.command), env=dict(self.env) if self.env
                                     is not None else None, cwd=self.cwd,
                                     stdout=self._log, stderr=subprocess.STDOUT
                                     if self._log is not None else None,
                                     start_new_session=True)
        self.started_at = time.monotonic()
        self.restart_at = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill_leftovers(self) -> None:
        """SIGKILL what remains of the exited child's process group (orphaned pool processes,
        an embedded beat): a restarted child must not run beside its predecessor's."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


class CriticalExit(RuntimeError):
    """A critical child exited: the supervisor stops (the caller decides what to say)."""

    def __init__(self, child: Child, code: int | None) -> None:
        super().__init__(f"{child.name} exited with status {code}")
        self.child, self.code = child, code


class Supervisor:
    """Start children, restart any that exits (1 s, doubling to 30 s; back to 1 s after a
    child stayed up a minute), stop them all with SIGTERM then SIGKILL. Call :meth:`poll`
    regularly (it never blocks); ``on_restart`` is told of each restart (for a log line)."""

    def __init__(self, children: Sequence[Child] = (), *,
                 on_restart: Callable[[Child, int | None], None] | None = None,
                 backoff_max: float = BACKOFF_MAX_S) -> None:
        self.children: list[Child] = list(children)
        self.on_restart = on_restart
        self.backoff_max = backoff_max

    def add(self, child: Child) -> Child:
        self.children.append(child)
        return child

    def start(self) -> None:
        for child in self.children:
            if child.proc is None:
                child.start()

    def poll(self) -> None:
        """Notice exits and perform due restarts; raise :class:`CriticalExit` when a critical
        child exited."""
        now = time.monotonic()
        for child in self.children:
            if child.proc is None:
                continue
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.restarts += 1
                    child.start()
                continue
            code = child.proc.poll()
            if code is None:
                continue
            child.kill_leftovers()
            if child.critical:
                raise CriticalExit(child, code)
            if now - child.started_at >= STABLE_AFTER_S:
                child.delay = BACKOFF_START_S
            child.restart_at = now + child.delay
            log.warning("%s (pid %s) exited with status %s; restarting in %.0f s", child.name,
                        child.proc.pid, code, child.delay)
            if self.on_restart is not None:
                self.on_restart(child, code)
            child.delay = min(child.delay * 2, self.backoff_max)

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM every live child (a Celery worker drains: its run checkpoints and is
        requeued, see :mod:`workers.drain`), SIGKILL those still alive after ``timeout``
        (default: the drain timeout plus 15 s, so a draining worker is not cut short)."""
        if timeout is None:
            timeout = drain.timeout_s() + 15.0
        for child in self.children:
            if child.alive():
                assert child.proc is not None
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait(timeout=10)
            child.kill_leftovers()
            child.close_log()


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            state = handle.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True
