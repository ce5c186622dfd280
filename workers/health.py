"""Liveness of a Celery worker, for an orchestrator: a heartbeat file and its check.

A Celery worker has no HTTP port to probe, and ``celery inspect ping`` goes through the
broker (slow, and it fails for every worker at once when the broker blips). Instead the
worker's main process rewrites a small JSON file every ``CRUCIBLE_WORKER_HEARTBEAT_S``
seconds (default 10) from the moment it is ready to take tasks (``workers/tasks.py`` starts
it), and removes it on a clean shutdown; ``python -m workers.health`` exits 0 when the file is
fresh and its process alive, else 1 with the reason: a container ``HEALTHCHECK`` or a
Kubernetes exec liveness probe. Standard library only: the probe starts in well under a
second and imports nothing heavy.

Files: ``CRUCIBLE_WORKER_HEARTBEAT_FILE`` if set, else ``<var>/health/<worker name>.json``;
the check without ``--file`` checks every file in that folder (one worker per container).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from workers.paths import var_dir

DEFAULT_INTERVAL_S = 10.0
DEFAULT_MAX_AGE_S = 60.0


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError as exc:
        raise SystemExit(f"{name} must be a number of seconds, not {raw!r}") from exc
    if value <= 0:
        raise SystemExit(f"{name} must be positive, not {raw!r}")
    return value


def interval(env: Mapping[str, str] = os.environ) -> float:
    return _seconds(env, "CRUCIBLE_WORKER_HEARTBEAT_S", DEFAULT_INTERVAL_S)


def health_dir() -> Path:
    return var_dir() / "health"


def heartbeat_path(worker_name: str, env: Mapping[str, str] = os.environ) -> Path:
    explicit = env.get("CRUCIBLE_WORKER_HEARTBEAT_FILE", "").strip()
    if explicit:
        return Path(explicit)
    return health_dir() / f"{re.sub(r'[^A-Za-z0-9_.@-]', '_', worker_name) or 'worker'}.json"


class Heartbeat:
    """Rewrites ``path`` every ``every`` seconds from a daemon thread: the process's id, the
    time, and what ``describe()`` adds (the worker's name, its broker connection)."""

    def __init__(self, path: Path, every: float,
                 describe: Callable[[], dict[str, Any]] | None = None) -> None:
        self.path, self.every = path, every
        self.describe = describe or dict
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat_once(self) -> None:
        try:
            extra = self.describe()
        except Exception as exc:  # describing must never stop the beat
            extra = {"describe_error": f"{type(exc).__name__}: {exc}"}
        body = {**extra, "pid": os.getpid(), "time": time.time(), "interval_s": self.every}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(body, sort_keys=True))
        os.replace(partial, self.path)  # a reader never sees half a file

    def start(self) -> None:
        self.beat_once()

        def loop() -> None:
            while not self._stop.wait(self.every):
                try:
                    self.beat_once()
                except OSError as exc:  # a full disk: the probe will say the file is stale
                    print(f"worker heartbeat {self.path}: {exc}", file=sys.stderr)

        self._thread = threading.Thread(target=loop, name="worker-heartbeat", daemon=True)
        self._thread.start()

    def stop(self, *, remove: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if remove:
            self.path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def check(path: Path, max_age: float = DEFAULT_MAX_AGE_S, now: float | None = None,
          ) -> tuple[bool, str]:
    """(healthy, why) for one heartbeat file."""
    try:
        body = json.loads(path.read_text())
        beat, pid = float(body["time"]), int(body["pid"])
    except FileNotFoundError:
        return False, f"no heartbeat at {path}: the worker is not running or not ready yet"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return False, f"unreadable heartbeat {path}: {exc}"
    age = (time.time() if now is None else now) - beat
    name = body.get("worker") or path.stem
    if age > max_age:
        return False, f"{name}: last heartbeat {age:.0f}s ago (more than {max_age:.0f}s)"
    if not _alive(pid):
        return False, f"{name}: process {pid} is gone"
    return True, f"{name}: alive (pid {pid}, heartbeat {max(age, 0):.0f}s ago)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workers.health",
        description="Exit 0 if this host's Celery worker(s) heartbeat recently, else 1.")
    parser.add_argument("--file", type=Path, default=None,
                        help="one heartbeat file (default: CRUCIBLE_WORKER_HEARTBEAT_FILE, "
                             "else every file in <var>/health/)")
    parser.add_argument("--max-age", type=float, default=None,
                        help="seconds a heartbeat stays fresh (default "
                             "CRUCIBLE_WORKER_HEALTH_MAX_AGE_S or 60)")
    args = parser.parse_args(argv)
    max_age = args.max_age or _seconds(os.environ, "CRUCIBLE_WORKER_HEALTH_MAX_AGE_S",
                                       DEFAULT_MAX_AGE_S)
    explicit = os.environ.get("CRUCIBLE_WORKER_HEARTBEAT_FILE", "").strip()
    if args.file is not None or explicit:
        files = [args.file or Path(explicit)]
    else:
        files = sorted(health_dir().glob("*.json"))
        if not files:
            print(f"unhealthy: no worker heartbeat in {health_dir()}")
            return 1
    results = [check(f, max_age) for f in files]
    for ok, why in results:
        print(("healthy: " if ok else "unhealthy: ") + why)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
