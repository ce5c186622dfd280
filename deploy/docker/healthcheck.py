"""Container health checks for Crucible's images: ``python healthcheck.py web|worker|beat``.

Exit 0 when healthy, 1 otherwise, with one line saying why (Docker keeps the last lines of a
check's output in ``docker inspect``). Standard library plus what the image already has
(celery, kombu); no Django, so a check never touches the database.

- ``web``: ``GET /healthz`` on this container answers 200.
- ``worker``: this container's Celery worker answers a broker ping, as
  ``celery -A config.celery inspect ping -d celery@$HOSTNAME`` would.
- ``beat``: the broker is reachable and the beat's schedule file was written recently (the beat
  rewrites it every few minutes while it ticks; a hung beat stops writing it).

The operations work (issue 21, item 6) adds ``/readyz`` and a worker health command; when it
lands, these checks call those instead.
"""

from __future__ import annotations

import glob
import os
import socket
import sys
import time
import urllib.error
import urllib.request

WEB_URL = "http://127.0.0.1:{port}/healthz"
# Celery's default worker name is celery@<host name>; worker.sh does not change it.
WORKER_NAME = "celery@{host}"
BEAT_SCHEDULE = "/var/lib/crucible/celerybeat-schedule"
BEAT_STALE_S = 600.0


def check_web(port: str | None = None) -> str | None:
    url = WEB_URL.format(port=port or os.environ.get("PORT", "8000"))
    try:
        with urllib.request.urlopen(url, timeout=4) as resp:  # noqa: S310 - a fixed local URL
            if resp.status == 200:
                return None
            return f"{url} answered {resp.status}"
    except (urllib.error.URLError, OSError) as exc:
        return f"{url}: {exc}"


def check_worker(host: str | None = None, timeout: float = 10.0) -> str | None:
    from config.celery import app

    name = WORKER_NAME.format(host=host or socket.gethostname())
    try:
        replies = app.control.ping(destination=[name], timeout=timeout) or []
    except Exception as exc:  # noqa: BLE001 - any broker error makes the worker unhealthy
        return f"ping {name}: {exc!r}"
    if any(name in reply for reply in replies):
        return None
    return f"{name} did not answer a ping within {timeout:g} s"


def schedule_age(pattern: str = BEAT_SCHEDULE, now: float | None = None) -> float | None:
    """Seconds since the beat last wrote its schedule (shelve may add a suffix), or None."""
    mtimes = [os.path.getmtime(p) for p in glob.glob(pattern + "*")]
    if not mtimes:
        return None
    return (time.time() if now is None else now) - max(mtimes)


def check_beat(timeout: float = 10.0) -> str | None:
    from config.celery import app

    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=timeout)
    except Exception as exc:  # noqa: BLE001
        return f"broker unreachable: {exc!r}"
    stale = float(os.environ.get("CRUCIBLE_BEAT_STALE_S", BEAT_STALE_S))
    age = schedule_age()
    if age is None:  # the beat writes it as it starts
        return f"no schedule file {BEAT_SCHEDULE}*: the beat is not running"
    if age > stale:
        return f"the beat has not written {BEAT_SCHEDULE} for {age:.0f} s (limit {stale:g})"
    return None


CHECKS = {"web": check_web, "worker": check_worker, "beat": check_beat}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in CHECKS:
        print(f"usage: healthcheck.py {'|'.join(CHECKS)}", file=sys.stderr)
        return 2
    problem = CHECKS[argv[0]]()
    print(f"{argv[0]}: {problem or 'ok'}")
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
