"""Real processes for the fault-injection tests: a uvicorn web process on the test database
that a test can stop and start again on the same port, a private redis-server, RabbitMQ node
and PostgreSQL cluster it can restart, Celery workers and node agents pointed at that web.
Every process started here is stopped by the fixture that made it (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings

from tests.e2e.conftest import ROOT
from tests.skips import host_skip


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


RABBITMQ_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"


def rabbitmq_server_binary() -> str | None:
    """The server script itself (Debian's /usr/sbin wrapper switches to the rabbitmq user and
    writes to the system node's log folder), else whatever is on PATH."""
    return RABBITMQ_SERVER if os.access(RABBITMQ_SERVER, os.X_OK) else \
        shutil.which("rabbitmq-server")


class RabbitServer:
    """A private RabbitMQ node (never the system one on 5672): its own node name, AMQP and
    distribution ports, database, logs, config and Erlang cookie under ``folder``. Stopping
    it is a clean shutdown (the server script turns SIGTERM into ``stop``); its durable queues
    and their messages survive a restart, as on a real server.

    ``consumer_timeout_ms``: the server's delivery-acknowledgement timeout (30 min by
    default), checked every second here, so a test can outlast it in seconds."""

    def __init__(self, folder: Path, consumer_timeout_ms: int | None = None) -> None:
        self.folder, self.port, self.dist_port = folder, free_port(), free_port()
        self.node = f"crucible-{self.port}@localhost"
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}//"
        self.proc: subprocess.Popen | None = None
        conf = [f"listeners.tcp.default = 127.0.0.1:{self.port}"]
        advanced = "[]."
        if consumer_timeout_ms is not None:
            conf.append(f"consumer_timeout = {consumer_timeout_ms}")
            advanced = "[{rabbit, [{channel_tick_interval, 1000}]}]."
        (folder / "rabbitmq.conf").write_text("\n".join(conf) + "\n")
        (folder / "advanced.config").write_text(advanced + "\n")
        (folder / "enabled_plugins").write_text("[].\n")

    def env(self) -> dict[str, str]:
        f = self.folder
        return {**os.environ, "HOME": str(f), "RABBITMQ_NODENAME": self.node,
                "RABBITMQ_NODE_PORT": str(self.port), "RABBITMQ_DIST_PORT": str(self.dist_port),
                "RABBITMQ_MNESIA_BASE": str(f / "mnesia"), "RABBITMQ_LOG_BASE": str(f / "log"),
                "RABBITMQ_CONFIG_FILE": str(f / "rabbitmq.conf"),
                "RABBITMQ_ADVANCED_CONFIG_FILE": str(f / "advanced.config"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(f / "enabled_plugins"),
                "RABBITMQ_PID_FILE": str(f / "rabbitmq.pid"),
                # Not /etc/rabbitmq/rabbitmq-env.conf: it names the system node.
                "RABBITMQ_CONF_ENV_FILE": str(f / "rabbitmq-env.conf")}

    def start(self) -> None:
        binary = rabbitmq_server_binary()
        assert binary is not None
        with (self.folder / "rabbitmq.out").open("ab") as out:
            self.proc = subprocess.Popen([binary], env=self.env(), cwd=self.folder, stdout=out,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120  # the Erlang VM boots in ~7 s on an idle host
        while not _listening(self.port):
            assert self.proc.poll() is None, tail(self.folder / "rabbitmq.out")
            assert time.monotonic() < deadline, "the RabbitMQ node did not start"
            time.sleep(0.2)

    def stop(self) -> None:
        _stop(self.proc, timeout=60)
        self.proc = None

    def log(self) -> str:
        return "".join(p.read_text(errors="replace")
                       for p in sorted((self.folder / "log").glob("*.log")))


def require_rabbitmq() -> None:
    if rabbitmq_server_binary() is None:
        host_skip("RabbitMQ is not installed on this host (apt-get install rabbitmq-server)")


@pytest.fixture(name="rabbit_server")
def rabbit_server_fixture(tmp_path: Path) -> Iterator[RabbitServer]:
    require_rabbitmq()
    folder = tmp_path / "rabbitmq"
    folder.mkdir()
    server = RabbitServer(folder)
    server.start()
    try:
        yield server
    finally:
        with contextlib.suppress(Exception):
            server.stop()


def postgres_bin() -> Path | None:
    """The newest installed PostgreSQL's server binaries (Debian: /usr/lib/postgresql/N/bin)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
                   key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit()
                   else 0)
    if found:
        return found[-1].parent
    pg_ctl = shutil.which("pg_ctl")
    return Path(pg_ctl).parent if pg_ctl else None


class PostgresCluster:
    """A private PostgreSQL cluster (never the system one on 5432): its own data folder, port
    and socket folder, trust authentication on 127.0.0.1. initdb refuses to run as root, so
    as root every server command runs as the ``postgres`` user; the folder is made for it.
    ``stop`` is ``pg_ctl -m fast stop`` (open sessions are ended, as in a restart)."""

    def __init__(self, binaries: Path) -> None:
        self.bin = binaries
        self.folder = Path(tempfile.mkdtemp(prefix="crucible-pg-"))
        self.data, self.port = self.folder / "data", free_port()
        self.database = "crucible"
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/{self.database}"
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust",
                  "--no-sync", "-E", "UTF8")

    def _run(self, tool: str, *args: str, timeout: float = 120) -> None:
        command = [str(self.bin / tool), *args]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, cwd=self.folder, capture_output=True, text=True,
                              timeout=timeout)
        assert done.returncode == 0, f"{tool} failed:\n{done.stdout}\n{done.stderr}"

    def start(self) -> None:
        options = (f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 "
                   "-c fsync=off -c full_page_writes=off")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.folder / "server.log"),
                  "-o", options, "-w", "-t", "90", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def load(self, source_url: str) -> None:
        """A database ``crucible`` holding a copy of ``source_url``'s schema and rows."""
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                  self.database)
        dump = subprocess.run([str(self.bin / "pg_dump"), "--no-owner", "--no-privileges",
                               "-d", source_url], capture_output=True, timeout=120)
        assert dump.returncode == 0, dump.stderr.decode(errors="replace")
        restore = subprocess.run([str(self.bin / "psql"), "-q", "-v", "ON_ERROR_STOP=1",
                                  "-d", self.url], input=dump.stdout, capture_output=True,
                                 timeout=120)
        assert restore.returncode == 0, restore.stderr.decode(errors="replace")

    def remove(self) -> None:
        with contextlib.suppress(Exception):
            if self.running():
                self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def log(self) -> str:
        return tail(self.folder / "server.log")


@pytest.fixture(name="postgres_cluster")
def postgres_cluster_fixture() -> Iterator[PostgresCluster]:
    if settings.DATABASES["default"]["ENGINE"].endswith("sqlite3"):
        host_skip("the PostgreSQL-stop fault copies the test database: it runs in the "
                  "PostgreSQL pass")
    binaries = postgres_bin()
    if binaries is None:
        host_skip("PostgreSQL's server binaries (initdb, pg_ctl) are not installed here")
    cluster = PostgresCluster(binaries)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.remove()
