"""The supervisor that `manage.py up` and the node agent use: a child that exits is started
again with backoff; a critical one stops the supervisor; stop ends them all."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from workers.supervise import Child, CriticalExit, Supervisor, pid_alive


def _poll_until(supervisor: Supervisor, predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        supervisor.poll()
        time.sleep(0.05)


def test_a_child_that_exits_is_restarted_and_a_critical_one_stops_the_supervisor(
        tmp_path: Path):
    marks = tmp_path / "starts"
    flaky = Child("flaky", [sys.executable, "-c",
                            f"open({str(marks)!r}, 'a').write('x')"])
    steady = Child("steady", [sys.executable, "-c", "import time; time.sleep(60)"])
    restarted: list[str] = []
    supervisor = Supervisor([flaky, steady], on_restart=lambda c, code: restarted.append(
        f"{c.name}:{code}"))
    supervisor.start()
    try:
        _poll_until(supervisor, lambda: flaky.restarts >= 2)
        assert restarted[:2] == ["flaky:0", "flaky:0"]
        assert flaky.delay == 4.0  # 1 s, then 2 s, doubling
        assert steady.alive() and steady.restarts == 0
        first = steady.pid
        assert first is not None and pid_alive(first)
        critical = supervisor.add(Child("web", [sys.executable, "-c", "raise SystemExit(3)"],
                                        critical=True))
        critical.start()
        with pytest.raises(CriticalExit) as stopped:
            _poll_until(supervisor, lambda: False)
        assert stopped.value.child is critical and stopped.value.code == 3
    finally:
        supervisor.stop(timeout=5)
    assert not steady.alive() and not pid_alive(first)
    assert len(marks.read_text()) >= 2


def test_what_a_killed_child_leaves_behind_is_ended_before_it_restarts(tmp_path: Path):
    """A child's own child (a Celery worker's embedded beat) outlives a SIGKILL of its parent;
    the supervisor ends it, so a restart never runs beside its predecessor's leftovers."""
    import os
    import signal

    pids = tmp_path / "grandchild"
    script = ("import subprocess, sys, time\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              f"open({str(pids)!r}, 'a').write(f'{{p.pid}}\\n')\n"
              "time.sleep(60)\n")
    child = Child("worker", [sys.executable, "-c", script])
    supervisor = Supervisor([child])
    supervisor.start()
    try:
        _poll_until(supervisor, lambda: pids.exists() and pids.read_text().count("\n") == 1)
        grandchild = int(pids.read_text().split()[0])
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        _poll_until(supervisor, lambda: child.restart_at is not None)
        _poll_until(supervisor, lambda: not pid_alive(grandchild), timeout=10)
        _poll_until(supervisor, lambda: child.restarts == 1 and child.alive())
    finally:
        supervisor.stop(timeout=5)
    deadline = time.monotonic() + 10  # a SIGKILL lands a moment after it is sent
    while any(pid_alive(int(p)) for p in pids.read_text().split()):
        assert time.monotonic() < deadline, "a grandchild outlived stop()"
        time.sleep(0.05)
