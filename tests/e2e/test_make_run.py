"""``make run``'s command on a fresh var/ folder: it must start web + worker, run the
demo profile job to success and print the URL and login."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_up_runs_the_demo_job_on_embedded_defaults(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "OBJECT_STORE_URL")}
    env["CRUCIBLE_VAR_DIR"] = str(tmp_path / "var")
    port = _free_port()
    result = subprocess.run(
        [sys.executable, "manage.py", "up", "--port", str(port), "--exit-after-demo"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert f"Crucible is running at http://127.0.0.1:{port}/" in out
    assert "login: admin / " in out
    assert ": succeeded" in out
    assert (tmp_path / "var" / "crucible.sqlite3").exists()
    assert any((tmp_path / "var" / "objects" / "reports").rglob("profile.json"))
