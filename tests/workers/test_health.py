"""The worker's health heartbeat and ``python -m workers.health`` (a container HEALTHCHECK
or Kubernetes exec probe): healthy only while a live worker's heartbeat is fresh."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workers import health

ROOT = Path(__file__).resolve().parents[2]


def test_a_fresh_heartbeat_is_healthy_and_stop_removes_it(tmp_path: Path) -> None:
    path = tmp_path / "health" / "cpu@host.json"
    beat = health.Heartbeat(path, every=30, describe=lambda: {"worker": "cpu@host"})
    beat.start()
    try:
        body = json.loads(path.read_text())
        assert body["pid"] == os.getpid() and body["worker"] == "cpu@host"
        ok, why = health.check(path, max_age=60)
        assert ok, why
        assert health.main(["--file", str(path)]) == 0
    finally:
        beat.stop()
    assert not path.exists()
    assert health.main(["--file", str(path)]) == 1


def test_a_stale_heartbeat_or_a_dead_process_is_unhealthy(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    health.Heartbeat(path, every=10).beat_once()
    written = json.loads(path.read_text())["time"]
    ok, why = health.check(path, max_age=60, now=written + 61)
    assert not ok and "61s ago" in why
    assert health.check(path, max_age=60, now=written + 59)[0]

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    path.write_text(json.dumps({"pid": int(gone.stdout), "time": time.time()}))
    ok, why = health.check(path)
    assert not ok and "is gone" in why

    path.write_text("{not json")
    assert not health.check(path)[0]


def test_without_a_file_every_heartbeat_in_the_folder_is_checked(tmp_path: Path,
                                                                 monkeypatch) -> None:
    monkeypatch.setenv("CRUCIBLE_VAR_DIR", str(tmp_path))
    monkeypatch.delenv("CRUCIBLE_WORKER_HEARTBEAT_FILE", raising=False)
    assert health.main([]) == 1  # no worker has started
    health.Heartbeat(health.heartbeat_path("gpu@a"), every=10).beat_once()
    assert health.main([]) == 0
    stale = health.heartbeat_path("cpu@b")
    stale.write_text(json.dumps({"pid": os.getpid(), "time": time.time() - 3600}))
    assert health.main([]) == 1
    assert health.heartbeat_path("a/b c") == tmp_path / "health" / "a_b_c.json"


@pytest.mark.slow
def test_a_celery_worker_heartbeats_until_it_stops(tmp_path: Path) -> None:
    """A real Celery worker (filesystem broker, no server): the probe fails before it is
    ready, passes while it runs, and fails again once SIGTERM has stopped it."""
    env = {**os.environ, "CRUCIBLE_VAR_DIR": str(tmp_path), "PYTHONPATH": str(ROOT),
           "CRUCIBLE_WORKER_HEARTBEAT_S": "1", "OMP_NUM_THREADS": "1"}
    env.pop("CELERY_BROKER_URL", None)
    env.pop("REDIS_URL", None)
    env.pop("CRUCIBLE_WORKER_HEARTBEAT_FILE", None)

    def probe() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "workers.health"], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=60)

    assert probe().returncode == 1
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "config.celery", "worker", "-P", "solo",
         "-Q", "cpu", "-n", "probe@test", "--loglevel", "WARNING"],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    path = tmp_path / "health" / "probe@test.json"
    try:
        deadline = time.monotonic() + 120
        while not path.exists() and worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert path.exists(), f"no heartbeat; worker exited {worker.poll()}"
        result = probe()
        assert result.returncode == 0, result.stdout
        assert "probe@test: alive" in result.stdout
        assert json.loads(path.read_text())["pid"] == worker.pid
    finally:
        worker.send_signal(signal.SIGTERM)
        output, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0, output
    assert not path.exists()
    assert probe().returncode == 1
