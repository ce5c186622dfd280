"""Lease files: a worker process announces the lease it holds; once the process is gone
(SIGKILL leaves the file behind) the node agent finds the lease among the dead ones."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from workers import liveness

ROOT = Path(__file__).resolve().parents[2]


def test_a_lease_file_lives_with_its_block_and_names_this_process(tmp_path: Path):
    with liveness.holding("run-1", "lease-1", "host:1", folder=tmp_path) as path:
        assert path is not None and path.exists()
        data = json.loads(path.read_text())
        assert (data["pid"], data["run"], data["lease_id"]) == (os.getpid(), "run-1", "lease-1")
        assert oct(path.stat().st_mode)[-3:] == "600"
        [held] = liveness.held_leases(tmp_path)
        assert not held.process_dead() and liveness.dead_leases(tmp_path) == []
    assert not any(tmp_path.iterdir())


def test_a_killed_holder_leaves_a_dead_lease(tmp_path: Path):
    script = ("import sys, time; from pathlib import Path; from workers import liveness\n"
              "with liveness.holding('run-2', 'lease-2', 'host:2', folder=Path(sys.argv[1])):\n"
              "    print('held', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        assert liveness.dead_leases(tmp_path) == []
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not liveness.dead_leases(tmp_path):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        [dead] = liveness.dead_leases(tmp_path)
        assert (dead.pid, dead.run_id, dead.lease_id) == (proc.pid, "run-2", "lease-2")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_recycled_pid_is_not_the_dead_worker(tmp_path: Path):
    """A live process whose start time differs from the file's is another process."""
    path = tmp_path / "1-run.json"
    path.write_text(json.dumps({"pid": os.getpid(), "started": "1", "run": "r",
                                "lease_id": "l", "worker": "w"}))
    [held] = liveness.held_leases(tmp_path)
    assert held.process_dead() == (liveness.process_start(os.getpid()) not in ("", "1"))
