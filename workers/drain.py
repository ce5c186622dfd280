"""Graceful worker shutdown (drain): SIGTERM stops a run at its next safe point, not mid-step.

Why: a deploy, a scale-down or a node drain sends the worker SIGTERM. Celery's warm shutdown
waits for the running task, which for a training run may be hours, and the platform then
kills the process and the run waits out its lease. Instead the process is told to drain:
a train run checkpoints its last completed step and stops (the preemption path); any other
run stops at its next report; the worker reports the attempt ``drained``, which releases the
lease and queues the run again at once, and the task returns so Celery can exit.

``request()`` is called in the process that got the signal (Celery's ``worker_shutting_down``
in its main process); pool processes of a prefork worker learn of it through SIGUSR2, which
:func:`install_child_handler` (set as each task starts) turns into a drain there. Past
``CRUCIBLE_DRAIN_TIMEOUT_S`` (default 60 s) the process exits anyway and the lease is left to
expire or to the node agent, which reports the dead worker.

Standard library only (engines' import rules).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger("crucible.drain")

TIMEOUT_VAR = "CRUCIBLE_DRAIN_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0
CHILD_SIGNAL = signal.SIGUSR2
EXIT_CODE = 75  # EX_TEMPFAIL: the drain ran out of time; the work is requeued elsewhere

_requested = threading.Event()
_lock = threading.Lock()
_watchdog: threading.Timer | None = None


def timeout_s(env: dict[str, str] | None = None) -> float:
    """``CRUCIBLE_DRAIN_TIMEOUT_S``: how long a draining process may take to stop its run
    (a positive number of seconds)."""
    raw = (env if env is not None else os.environ).get(TIMEOUT_VAR, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"{TIMEOUT_VAR} must be a number of seconds, not {raw!r}") from exc
    if value <= 0:
        raise ValueError(f"{TIMEOUT_VAR} must be positive, not {raw!r}")
    return value


def enabled(env: dict[str, str] | None = None) -> bool:
    """``CRUCIBLE_DRAIN=0`` turns draining off: SIGTERM is then Celery's plain warm shutdown
    (the worker stops taking messages and exits when its running task is done), for an
    operator who would rather wait than checkpoint, and for tests that rely on that."""
    raw = (env if env is not None else os.environ).get("CRUCIBLE_DRAIN", "1").strip().lower()
    return raw not in ("0", "false", "no", "off")


def requested() -> bool:
    """Whether this process is draining: runs stop at their next safe point."""
    return _requested.is_set()


def request(reason: str = "SIGTERM", *, exit_after: float | None = None,
            on_timeout: Callable[[], None] | None = None) -> None:
    """Start draining this process (idempotent). After ``exit_after`` seconds (default
    :func:`timeout_s`) the process exits with status 75, whatever it is doing;
    ``on_timeout`` runs first (to kill pool processes)."""
    global _watchdog
    with _lock:
        if _requested.is_set():
            return
        _requested.set()
        limit = timeout_s() if exit_after is None else exit_after
        log.warning("draining (%s): running work stops at its next safe point; exiting in "
                    "at most %.0f s", reason, limit)

        def expire() -> None:
            log.error("drain did not finish within %.0f s; exiting and leaving the run's "
                      "lease to expire", limit)
            if on_timeout is not None:
                with contextlib.suppress(Exception):
                    on_timeout()
            os._exit(EXIT_CODE)

        _watchdog = threading.Timer(limit, expire)
        _watchdog.daemon = True
        _watchdog.name = "drain-watchdog"
        _watchdog.start()


def reset() -> None:
    """Forget a drain (tests that drain in-process)."""
    global _watchdog
    with _lock:
        if _watchdog is not None:
            _watchdog.cancel()
            _watchdog = None
        _requested.clear()


def signal_children(pids: Iterable[int]) -> None:
    """Tell pool processes to drain (they installed :func:`install_child_handler`)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, CHILD_SIGNAL)


def kill_children(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def install_child_handler() -> None:
    """In a pool process: SIGUSR2 starts a drain here (with its own deadline). Only the main
    thread may set a handler; a threads pool's tasks run beside the main process's, which
    got the SIGTERM itself."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handle(signum: int, frame: Any) -> None:
        request_soon("SIGUSR2 from the worker's main process")

    signal.signal(CHILD_SIGNAL, handle)


def request_soon(reason: str, on_timeout: Callable[[], None] | None = None) -> None:
    """:func:`request` from a signal handler: in a thread of its own, since a handler must
    not take locks (logging's, the drain's) the code it interrupted may hold."""
    threading.Thread(target=request, args=(reason,), kwargs={"on_timeout": on_timeout},
                     name="drain", daemon=True).start()

