"""A rank whose peer never joins a collective fails within ``CRUCIBLE_DIST_TIMEOUT_S`` instead
of hanging: two real processes on gloo, rank 1 alive but silent."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.rl.distributed import collective_timeout, free_port

REPO = Path(__file__).resolve().parents[3]

RANK = """
import sys, time, torch
from workers.rl.distributed import all_reduce_sum, process_group
with process_group() as (rank, world):
    if rank == 1:
        time.sleep(120)  # alive, never joins the collective
    else:
        try:
            all_reduce_sum(torch.ones(1))
        except Exception as exc:
            print("collective failed:", type(exc).__name__, str(exc)[:200], flush=True)
            sys.exit(7)
        print("collective returned", flush=True)
"""


def test_collective_timeout_setting(monkeypatch):
    monkeypatch.delenv("CRUCIBLE_DIST_TIMEOUT_S", raising=False)
    assert collective_timeout() is None
    monkeypatch.setenv("CRUCIBLE_DIST_TIMEOUT_S", "2.5")
    assert collective_timeout().total_seconds() == 2.5
    monkeypatch.setenv("CRUCIBLE_DIST_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match="positive number of seconds"):
        collective_timeout()


@pytest.mark.slow
def test_a_collective_missing_a_peer_raises_within_the_timeout(tmp_path):
    port = str(free_port())
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "CRUCIBLE_DEVICE": "cpu",
               "CRUCIBLE_DIST_TIMEOUT_S": "5"}
        procs.append(subprocess.Popen([sys.executable, "-c", RANK], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        out, _ = procs[0].communicate(timeout=110)  # well before rank 1 wakes up
        assert procs[0].returncode == 7, out[-2000:]
        assert "collective failed" in out and "Timed out waiting 5000ms" in out, out[-2000:]
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
