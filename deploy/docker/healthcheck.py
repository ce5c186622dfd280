"""Container health checks for the web and beat images: ``python healthcheck.py web|beat``.

Exit 0 when healthy, 1 otherwise, with one line saying why (Docker keeps the last lines of a
check's output in ``docker inspect``). Standard library plus what the image already has
(celery, kombu); no Django. The workers' images use Crucible's own probe instead,
``python -m workers.health`` (docs/operations.md).

- ``web``: ``GET /readyz`` on this container answers 200: the database answers, every
  migration is applied, the channel layer and the broker answer. Compose's
  ``service_healthy`` therefore means "ready to serve". (Kubernetes probes ``/healthz`` for
  liveness and ``/readyz`` for readiness itself.)
- ``beat``: the broker is reachable and the beat's schedule file was written recently (the beat
  rewrites it every few minutes while it ticks; a hung beat stops writing it). Crucible has no
  probe of its own for a standalone beat.
"""

from __future__ import annotations

import glob
import os
import sys
import time
import urllib.error
import urllib.request

WEB_URL = "http://127.0.0.1:{port}{path}"
WEB_PATH = "/readyz"
BEAT_SCHEDULE = "/var/lib/crucible/celerybeat-schedule"
BEAT_STALE_S = 600.0


def check_web(port: str | None = None, path: str = WEB_PATH) -> str | None:
    url = WEB_URL.format(port=port or os.environ.get("PORT", "8000"), path=path)
    try:
        with urllib.request.urlopen(url, timeout=4) as resp:  # noqa: S310 - a fixed local URL
            if resp.status == 200:
                return None
            return f"{url} answered {resp.status}"
    except urllib.error.HTTPError as exc:  # 503 from /readyz: its body names the failing check
        body = exc.read(500).decode("utf-8", "replace")
        return f"{url} answered {exc.code}: {body}"
    except (urllib.error.URLError, OSError) as exc:
        return f"{url}: {exc}"


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
    except Exception as exc:  # noqa: BLE001 - any broker error makes the beat unhealthy
        return f"broker unreachable: {exc!r}"
    stale = float(os.environ.get("CRUCIBLE_BEAT_STALE_S", BEAT_STALE_S))
    age = schedule_age()
    if age is None:  # the beat writes it as it starts
        return f"no schedule file {BEAT_SCHEDULE}*: the beat is not running"
    if age > stale:
        return f"the beat has not written {BEAT_SCHEDULE} for {age:.0f} s (limit {stale:g})"
    return None


CHECKS = {"web": check_web, "beat": check_beat}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in CHECKS:
        print(f"usage: healthcheck.py {'|'.join(CHECKS)}", file=sys.stderr)
        return 2
    problem = CHECKS[argv[0]]()
    print(f"{argv[0]}: {problem or 'ok'}")
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
