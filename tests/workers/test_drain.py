"""workers.drain in real processes: the flag, SIGUSR2 from a worker's main process, and the
watchdog that ends a drain that takes too long."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from workers import drain

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, text=True,
                          capture_output=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def test_the_timeout_is_read_and_checked():
    assert drain.timeout_s({}) == drain.DEFAULT_TIMEOUT_S
    assert drain.timeout_s({drain.TIMEOUT_VAR: "2.5"}) == 2.5
    for bad in ("soon", "0", "-3"):
        with pytest.raises(ValueError, match=drain.TIMEOUT_VAR):
            drain.timeout_s({drain.TIMEOUT_VAR: bad})


def test_sigusr2_drains_a_pool_process_and_the_watchdog_ends_a_drain_that_overruns():
    done = _python("""
        import os, signal, time
        from workers import drain
        drain.install_child_handler()
        assert not drain.requested()
        os.kill(os.getpid(), signal.SIGUSR2)
        deadline = time.monotonic() + 10
        while not drain.requested() and time.monotonic() < deadline:
            time.sleep(0.05)
        print("drained", drain.requested(), flush=True)
        time.sleep(30)  # a run that does not stop: the watchdog exits the process
        print("not reached")
    """, CRUCIBLE_DRAIN_TIMEOUT_S="0.5")
    assert done.stdout.splitlines() == ["drained True"], done.stderr
    assert done.returncode == drain.EXIT_CODE, done.stderr
    assert "did not finish within" in done.stderr


def test_a_drain_that_finishes_in_time_exits_normally():
    done = _python("""
        from workers import drain
        drain.request("test", exit_after=30)
        drain.request("again")  # idempotent: one watchdog
        print(drain.requested())
    """)
    assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr
