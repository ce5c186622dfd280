"""Real processes for the fault-injection tests: a uvicorn web process on the test database
that a test can stop and start again on the same port, a private redis-server it can restart,
Celery workers and node agents pointed at that web. Every process started here is stopped by
the fixture that made it (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings

from tests.e2e.conftest import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def database_url() -> str:
    """The test database, for a process other than the test's own."""
    db = settings.DATABASES["default"]
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    auth = db["USER"] + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _stop(proc: subprocess.Popen | None, timeout: float = 15) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


class Processes:
    """What one test started; ``close`` stops them all, the most recent first."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.web: subprocess.Popen | None = None
        self.web_env: dict[str, str] = {}

    def spawn(self, command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        with log.open("ab") as out:
            proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out,
                                    stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    # -- the web -------------------------------------------------------------------------
    def start_web(self, **extra: str) -> subprocess.Popen:
        """uvicorn serving config.asgi on the test database and this test's object store,
        on this test's port (the same one after a restart)."""
        if extra or not self.web_env:
            self.web_env = {**os.environ, "DATABASE_URL": database_url(),
                            "OBJECT_STORE_URL": settings.OBJECT_STORE_URL,
                            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}
        self.web = self.spawn([sys.executable, "-m", "uvicorn", "config.asgi:application",
                               "--port", str(self.port), "--log-level", "warning"],
                              self.web_env, self.tmp / f"web-{self.port}.log")
        deadline = time.monotonic() + 90
        while not _listening(self.port):
            assert self.web.poll() is None, \
                f"the web process exited:\n{tail(self.tmp / f'web-{self.port}.log')}"
            assert time.monotonic() < deadline, "the web process did not start"
            time.sleep(0.2)
        return self.web

    def another_web(self) -> Processes:
        """A second web process on another port, same database, Redis and object store
        (stopped with this one's)."""
        other = Processes(self.tmp)
        other.procs = self.procs
        other.web_env = {**self.web_env}
        other.start_web()
        return other

    def stop_web(self) -> None:
        _stop(self.web)
        self.web = None

    # -- workers and agents ----------------------------------------------------------------
    def worker_env(self, token: str, **extra: str) -> dict[str, str]:
        env = {**os.environ, "CRUCIBLE_API_URL": self.url, "CRUCIBLE_WORKER_TOKEN": token,
               "OBJECT_STORE_URL": settings.OBJECT_STORE_URL, "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": "1", **extra}
        env.pop("DATABASE_URL", None)  # workers hold no database credentials
        return env

    def start_worker(self, token: str, log: Path, queues: str = "gpu,cpu",
                     **extra: str) -> subprocess.Popen:
        return self.spawn(worker_command(queues), self.worker_env(token, **extra), log)

    def start_agent(self, token: str, log: Path, **extra: str) -> subprocess.Popen:
        env = self.worker_env(token, CRUCIBLE_NODE_HEARTBEAT_S="2", CRUCIBLE_NODE_PROBE="none",
                              **extra)
        return self.spawn([sys.executable, "-m", "workers.agent"], env, log)

    def close(self) -> None:
        for proc in reversed(self.procs):
            _stop(proc)


def worker_command(queues: str, *, like_up: bool = False) -> list[str]:
    """A quiet one-process worker; ``like_up``: the worker ``manage.py up`` runs (a prefork
    pool, with gossip, mingle and heartbeats: the broker traffic of a real pool)."""
    base = [sys.executable, "-m", "celery", "-A", "config.celery", "worker", "-Q", queues]
    if like_up:
        return [*base, "-c", "1", "--loglevel", "INFO"]
    return [*base, "-P", "solo", "--without-gossip", "--without-mingle", "--without-heartbeat",
            "--loglevel", "INFO"]


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


@pytest.fixture(name="processes")
def processes_fixture(transactional_db: None, tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.close()


class RedisServer:
    """A private redis-server on a free port (never the shared 6379), no persistence."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None
        with (self.folder / "redis.log").open("ab") as out:
            self.proc = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.folder)], stdout=out,
                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not _listening(self.port):
            assert self.proc.poll() is None, tail(self.folder / "redis.log")
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.1)

    def stop(self) -> None:
        _stop(self.proc)
        self.proc = None


@pytest.fixture(name="redis_server")
def redis_server_fixture(tmp_path: Path) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server missing: apt-get install redis-server")
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        with contextlib.suppress(Exception):
            server.stop()
