"""Metric ingest next to MLflow's tracking server, and reading a 1M-point series back.

Run from the repository root: `.venv/bin/python tests/benchmarks/bench_ingest.py`
(`make bench-ingest`). Needs PostgreSQL at BENCH_PG (default postgresql://postgres@127.0.0.1:5432,
trust auth); uses Redis for Crucible's channel layer when BENCH_REDIS_URL answers. The first run
creates var/bench/mlflow-venv (pip install mlflow + psycopg2-binary).

What it does, acting as an outside client (this process never imports Django):

1. Crucible: drop+create database `crucible_bench`, `manage.py migrate`, a user, team, tokens
   (`manage.py shell`), then the real server (uvicorn config.asgi:application, 2 workers,
   DEBUG off) on a free port. A project, dataset and the runs are made through the API.
2. MLflow: drop+create database `mlflow_bench`, `mlflow server` (2 workers) on it.
3. Ingest: W writer processes per side, each sending B batches of 1000 points (8 series x 125
   steps, steps increasing) — Crucible through `WorkerSession.log_metrics` on a claimed run,
   MLflow through `MlflowClient.log_batch` on its own run. Points / wall time from "go" to the
   last writer done; R repeats, sides interleaved, medians quoted.
   Raw COPY: the same points into the same table from one client (no HTTP, no validation),
   one COPY and commit per batch, each repeat: the database's own limit on this workload.
4. Read: one series of 1,000,000 points loaded into a run with SQL, then N GETs of
   `runs/<id>/metrics?name=<series>&max_points=1000&layout=columns` (the run page's read:
   merged from the rollups); p95. Then 100 series x 100,000 points in one run, all read in
   one GET (1000 buckets each, from the rollups); median. Each GET's time includes the
   client's parse of the JSON.

Ends with (DESIGN.md "Benchmarks"):
    ingest: crucible=<pts/s> mlflow=<pts/s> ratio=<c/m> target=>=10
    ingest_vs_copy: crucible=<pts/s> copy=<pts/s> ratio=<c/copy> target=>=0.5
    read_1m_p95_ms: crucible=<ms> target=<=50
    read_100x100k_ms: crucible=<median ms> target=<=300
    ingest_concurrent_10m: crucible=<pts/s> lost=<n> duplicated=<n> target=lost==0,duplicated==0
    ingest_concurrent_restart: (the same, every web process restarted once mid-load)
Each line also says the body encoding and the load average it was measured at (load=).
The concurrent figures: BENCH_CONCURRENT_POINTS (10,000,000) from BENCH_CONCURRENT_CLIENTS (16)
writer processes (tests/e2e/metric_writer.py, one run each) over BENCH_CONCURRENT_WEBS (2) web
processes of their own, BENCH_CONCURRENT_BATCH (1000) points a batch, counted in the database
afterwards (lost, duplicated, wrong values); the run exits 1 if any is not 0.
Progress goes to stderr; logs of every process it starts go to var/bench/logs/.

Knobs (environment): BENCH_BODY (msgpack | json-columns | json-rows: how writers encode
batches), BENCH_WIDE_SERIES (100), BENCH_WIDE_POINTS (100000), BENCH_WIDE_READS (10),
BENCH_WRITERS (4), BENCH_BATCHES (50), BENCH_REPEATS (3), BENCH_READS (50),
BENCH_READ_POINTS (1000000), BENCH_PG, BENCH_REDIS_URL (redis://127.0.0.1:6379/13; "" for none),
BENCH_CRUCIBLE_DB / BENCH_MLFLOW_DB (crucible_bench / mlflow_bench), BENCH_MLFLOW_SPEC
(mlflow==3.17.2), BENCH_SERVER_WORKERS (2), BENCH_KEEP_DB (0: drop both databases at the end),
BENCH_SECTIONS (ingest,read,concurrent,restart: which parts to run), BENCH_DB_POOL (10: each
Crucible web process's database pool, DATABASE_POOL_SIZE; 0 for none), BENCH_LOAD_PROCS (0:
this many `nice -n 19` busy loops in the background, to hold the figures at a known load).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psycopg  # noqa: E402

from workers.client import CrucibleClient  # noqa: E402

BENCH_DIR = ROOT / "var" / "bench"
LOGS = BENCH_DIR / "logs"
MLFLOW_VENV = BENCH_DIR / "mlflow-venv"
MLFLOW_WRITER = Path(__file__).resolve().parent / "_mlflow_writer.py"
NAMES = ["loss", "reward", "kl", "entropy", "lr", "grad_norm", "response_len", "advantage"]
BATCH_SIZE = 1000  # MLflow's log_batch cap; Crucible accepts up to 10,000
TEAM, PROJECT, DATASET = "bench", "bench", "bench"


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, "") or default)


WRITERS = _env_int("BENCH_WRITERS", 4)
# 50: at 10 a Crucible round was 40,000 points, over in ~0.5 s, and its rate moved 71-109k
# within one run; at 50 (200,000 points, ~2 s) the three repeats agreed within 2%.
BATCHES = _env_int("BENCH_BATCHES", 50)
REPEATS = _env_int("BENCH_REPEATS", 3)
READS = _env_int("BENCH_READS", 50)
READ_POINTS = _env_int("BENCH_READ_POINTS", 1_000_000)
WIDE_SERIES = _env_int("BENCH_WIDE_SERIES", 100)
WIDE_POINTS = _env_int("BENCH_WIDE_POINTS", 100_000)
WIDE_READS = _env_int("BENCH_WIDE_READS", 10)
BODY = os.environ.get("BENCH_BODY", "msgpack")  # workers.client.METRIC_ENCODINGS
SERVER_WORKERS = _env_int("BENCH_SERVER_WORKERS", 2)
PG = os.environ.get("BENCH_PG", "postgresql://postgres@127.0.0.1:5432").rstrip("/")
REDIS = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")
CRUCIBLE_DB = os.environ.get("BENCH_CRUCIBLE_DB", "crucible_bench")
MLFLOW_DB = os.environ.get("BENCH_MLFLOW_DB", "mlflow_bench")
MLFLOW_SPEC = os.environ.get("BENCH_MLFLOW_SPEC", "mlflow==3.17.2")
# uvicorn restarts a worker that misses a 5 s ping; on a loaded 2-core machine a busy worker
# can, which kills its in-flight request. Both servers get the same longer allowance.
HEALTHCHECK_S = 60
KEEP_DB = os.environ.get("BENCH_KEEP_DB", "0") not in ("", "0", "false")
# Concurrency and volume (issue 25, item 3): CONCURRENT_POINTS from CONCURRENT_CLIENTS writer
# processes spread over CONCURRENT_WEBS web processes (one uvicorn each, own port), counted
# back in the database; then again with every web process restarted once mid-load.
CONCURRENT_POINTS = _env_int("BENCH_CONCURRENT_POINTS", 10_000_000)
CONCURRENT_CLIENTS = _env_int("BENCH_CONCURRENT_CLIENTS", 16)
CONCURRENT_WEBS = _env_int("BENCH_CONCURRENT_WEBS", 2)
CONCURRENT_BATCH = _env_int("BENCH_CONCURRENT_BATCH", BATCH_SIZE)
# Each Crucible web process's database pool (DATABASE_POOL_SIZE); 0: Django's persistent
# connections, which under ASGI pile up with many concurrent clients (see config/settings.py).
DB_POOL = _env_int("BENCH_DB_POOL", 10)
# Which parts to run: ingest (with raw COPY), read, concurrent, restart (the concurrent round
# with the web processes restarted mid-load).
SECTIONS = set(os.environ.get("BENCH_SECTIONS", "ingest,read,concurrent,restart").split(","))
# Background load: this many `nice -n 19` busy loops for the whole run, so the figures are
# taken at a known floor of load (the targets are set at a load average of 4).
LOAD_PROCS = _env_int("BENCH_LOAD_PROCS", 0)


def say(message: str) -> None:
    print(f"[bench-ingest {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_answers(url: str) -> bool:
    if not url:
        return False
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 6379),
                                      timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


# --- processes ------------------------------------------------------------------------------
class Processes:
    """Every long-lived process this benchmark starts, each in its own process group."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(LOGS / f"{name}.log", "wb")  # noqa: SIM115 - the child keeps its own fd
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        log.close()
        self.procs.append((name, proc))
        return proc

    def stop(self, proc: subprocess.Popen, timeout: float = 15) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout)
        # The server's own children (uvicorn/gunicorn workers) share its process group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)

    def stop_all(self) -> None:
        for name, proc in reversed(self.procs):
            say(f"stopping {name} (pid {proc.pid})")
            self.stop(proc)
            log = (LOGS / f"{name}.log").read_text(errors="replace")
            if "died" in log or "Traceback" in log:
                say(f"warning: {name} restarted a worker or logged an error; figures may be off "
                    f"(see {LOGS / (name + '.log')})")
        self.procs.clear()


def wait_http(url: str, proc: subprocess.Popen, name: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited at start; see {LOGS / (name + '.log')}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{name} did not answer {url} within {timeout:.0f} s")


def run_writers(name: str, cmd: list[str], env: dict[str, str],
                configs: list[dict[str, Any]]) -> tuple[float, list[dict[str, Any]]]:
    """Start one writer process per config, wait until all are ready (setup done, batches
    built), say go, and time until the last one is done. Returns (points/s, results)."""
    procs = []
    logs = []
    try:
        for i, cfg in enumerate(configs):
            log = open(LOGS / f"{name}-writer-{i}.log", "w")  # noqa: SIM115
            logs.append(log)
            proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log, text=True,
                                    start_new_session=True)
            procs.append(proc)
            proc.stdin.write(json.dumps(cfg) + "\n")
            proc.stdin.flush()
        for i, proc in enumerate(procs):
            if _read_protocol(proc) != "ready":
                raise RuntimeError(f"{name} writer {i} failed to start; see "
                                   f"{LOGS / f'{name}-writer-{i}.log'}")
        start = time.perf_counter()
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = []
        for i, proc in enumerate(procs):
            line = _read_protocol(proc)
            if not line or not line.startswith("{"):
                raise RuntimeError(f"{name} writer {i} failed; see "
                                   f"{LOGS / f'{name}-writer-{i}.log'}")
            results.append(json.loads(line))
        elapsed = time.perf_counter() - start
        for proc in procs:
            proc.stdin.close()
            proc.wait(timeout=60)
        points = sum(r["points"] for r in results)
        expected = sum(cfg["batches"] for cfg in configs) * BATCH_SIZE
        if points != expected:
            raise RuntimeError(f"{name}: writers stored {points} points, expected {expected}")
        return points / elapsed, results
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for log in logs:
            log.close()


def _read_protocol(proc: subprocess.Popen) -> str | None:
    while True:
        line = proc.stdout.readline()
        if not line:
            return None
        if line.startswith("BENCH "):
            return line[6:].strip()


# --- PostgreSQL -----------------------------------------------------------------------------
def recreate_db(name: str) -> None:
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def drop_db(name: str) -> None:
    with contextlib.suppress(psycopg.Error), psycopg.connect(f"{PG}/postgres",
                                                             autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# --- Crucible -------------------------------------------------------------------------------
SETUP_CODE = f"TEAM = {TEAM!r}" + """
import json
from django.contrib.auth import get_user_model
from apps.core.actor import Actor
from apps.teams.services import personal_token_create, team_create, worker_token_create
user = get_user_model().objects.create_user("bench", "bench@localhost", "bench-password-unused")
team_create(actor=Actor.of_user(user), slug=TEAM, name="Benchmark")
_, personal = personal_token_create(actor=Actor.system(), user=user, name="bench")
_, worker = worker_token_create(actor=Actor.system(), team=None, name="bench-pool")
print("BENCH " + json.dumps({"personal": personal, "worker": worker}))
"""


class Crucible:
    def __init__(self, procs: Processes) -> None:
        self.procs = procs
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "DATABASE_URL": f"{PG}/{CRUCIBLE_DB}".replace("postgresql://", "postgres://", 1),
            "CRUCIBLE_VAR_DIR": str(BENCH_DIR),
            "CELERY_BROKER_URL": "filesystem://",  # launched runs wait in var/bench/broker
            "DEBUG": "false",
            "LOG_LEVEL": "WARNING",
            "CRUCIBLE_PUBLIC_URL": self.url,
            "PYTHONUNBUFFERED": "1",
        }
        for var in ("REDIS_URL", "OBJECT_STORE_URL", "CONN_MAX_AGE", "DATABASE_POOL_SIZE"):
            self.env.pop(var, None)
        if redis_answers(REDIS):
            self.env["REDIS_URL"] = REDIS  # channel layer, as in production
        if DB_POOL:  # see config/settings.py: persistent connections leak under ASGI
            self.env["DATABASE_POOL_SIZE"] = str(DB_POOL)
        self.personal = self.worker = ""
        self.client: CrucibleClient | None = None

    def setup(self) -> None:
        say(f"crucible: database {CRUCIBLE_DB}, migrate, user/team/tokens")
        recreate_db(CRUCIBLE_DB)
        manage = [sys.executable, str(ROOT / "manage.py")]
        subprocess.run([*manage, "migrate", "--noinput", "-v", "0"], env=self.env, cwd=ROOT,
                       check=True)
        out = subprocess.run([*manage, "shell", "-c", SETUP_CODE], env=self.env, cwd=ROOT,
                             check=True, capture_output=True, text=True).stdout
        tokens = json.loads(next(ln[6:] for ln in out.splitlines() if ln.startswith("BENCH ")))
        self.personal, self.worker = tokens["personal"], tokens["worker"]
        say(f"crucible: starting uvicorn config.asgi:application --workers {SERVER_WORKERS} "
            f"on {self.url} (channel layer: {self.env.get('REDIS_URL', 'in-memory')})")
        proc = self.procs.start("crucible-web", [
            sys.executable, "-m", "uvicorn", "config.asgi:application", "--host", "127.0.0.1",
            "--port", str(self.port), "--workers", str(SERVER_WORKERS), "--log-level", "warning",
            "--no-access-log", "--timeout-worker-healthcheck", str(HEALTHCHECK_S),
        ], self.env)
        wait_http(f"{self.url}/healthz", proc, "crucible-web")
        self.client = CrucibleClient(self.url, self.personal, timeout=120)
        self.client.create_project(TEAM, PROJECT, "Benchmark")
        self.client.create_dataset(TEAM, DATASET, PROJECT, "one record, for runs to pin")
        self.client.upload_version(TEAM, DATASET, [{"prompt": "1+1=", "answer": "2"}])

    def launch(self, name: str) -> str:
        assert self.client is not None
        run = self.client.launch_run(TEAM, project=PROJECT, kind="profile", name=name,
                                     datasets=[DATASET])
        return run["id"]

    def ingest_round(self, r: int, batches: int = BATCHES) -> float:
        configs = [{"url": self.url, "token": self.worker, "batches": batches,
                    "batch_size": BATCH_SIZE, "names": NAMES, "writer": i, "body": BODY,
                    "run_id": self.launch(f"ingest r{r} w{i}")} for i in range(WRITERS)]
        cmd = [sys.executable, str(Path(__file__).resolve()), "--writer"]
        rate, _ = run_writers("crucible", cmd, self.env, configs)
        for cfg in configs:  # stored, not just acknowledged: count them back through the API
            body = self.client.run_metrics(TEAM, cfg["run_id"], max_points=10)
            stored = sum(p["count"] for s in body["series"] for p in s["points"])
            if stored != batches * BATCH_SIZE:
                raise RuntimeError(f"crucible run {cfg['run_id']} holds {stored} points, "
                                   f"expected {batches * BATCH_SIZE}")
        return rate

    def copy_round(self, r: int, batches: int = BATCHES) -> float:
        """The database's own limit on these points: raw COPY into the same table from one
        client, one COPY and commit per batch of BATCH_SIZE (the atomic unit ingest keeps), no
        HTTP, validation, dedup or stream. Points per second, stored counted back."""
        run_id = uuid.UUID(self.launch(f"copy r{r}"))
        per_batch = BATCH_SIZE // len(NAMES)
        now = time.time()
        with psycopg.connect(f"{PG}/{CRUCIBLE_DB}", autocommit=True) as conn:
            buffers = []
            for b in range(batches * WRITERS):
                lines = []
                for i in range(per_batch):
                    step = b * per_batch + i
                    for k, name in enumerate(NAMES):
                        lines.append(f"{run_id}\t{name}\t{step}\t{math.sin(step / 100.0 + k)!r}"
                                     f"\t{now + step / 1000.0!r}\n")
                buffers.append("".join(lines).encode())
            start = time.perf_counter()
            for buffer in buffers:
                with conn.transaction(), conn.cursor() as cur, cur.copy(
                        "COPY metrics_metricpoint (run_id, name, step, value, wall_time) "
                        "FROM STDIN") as copy:
                    copy.write(buffer)
            elapsed = time.perf_counter() - start
            stored = conn.execute("SELECT count(*) FROM metrics_metricpoint WHERE run_id = %s",
                                  (run_id,)).fetchone()[0]
        if stored != batches * WRITERS * BATCH_SIZE:
            raise RuntimeError(f"COPY stored {stored} points, expected "
                               f"{batches * WRITERS * BATCH_SIZE}")
        return stored / elapsed

    def read_1m(self) -> list[float]:
        assert self.client is not None
        run_id = self.launch("read 1m")
        say(f"crucible: loading {READ_POINTS} points of series 'loss' into run {run_id} (SQL)")
        with psycopg.connect(f"{PG}/{CRUCIBLE_DB}", autocommit=True) as conn:
            conn.execute(
                "INSERT INTO metrics_metricpoint (run_id, name, step, value, wall_time) "
                "SELECT %s, 'loss', g, sin(g / 5000.0) + random() * 0.1, 1.7e9 + g "
                "FROM generate_series(0, %s - 1) AS g",
                (uuid.UUID(run_id), READ_POINTS),
            )
        # Loaded around the ingest API, so the rollups that ingest maintains are rebuilt
        # from the points (what an operator does after a bulk import).
        subprocess.run([sys.executable, str(ROOT / "manage.py"), "rebuild_metric_rollups",
                        "--run", run_id], env=self.env, cwd=ROOT, check=True,
                       capture_output=True)
        with psycopg.connect(f"{PG}/{CRUCIBLE_DB}", autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE metrics_metricpoint")
            conn.execute("VACUUM ANALYZE metrics_metricrollup")
        times = []
        for i in range(3 + READS):
            t = time.perf_counter()
            body = self.client.run_metrics(TEAM, run_id, names=["loss"], max_points=1000,
                                           layout="columns")
            ms = (time.perf_counter() - t) * 1000
            columns = body["series"][0]["columns"]
            if len(columns["step"]) != min(1000, READ_POINTS) or \
                    sum(columns["count"]) != READ_POINTS:
                raise RuntimeError(f"read returned {len(columns['step'])} buckets covering "
                                   f"{sum(columns['count'])} points")
            if i >= 3:  # the first calls warm caches and connections
                times.append(ms)
        return times


    def read_wide(self) -> list[float]:
        """WIDE_SERIES series of WIDE_POINTS points each in one run, all read in one GET of
        1000 buckets per series (from the rollups). Milliseconds per GET."""
        assert self.client is not None
        run_id = self.launch("read wide")
        say(f"crucible: loading {WIDE_SERIES} series x {WIDE_POINTS:,} points into run "
            f"{run_id} (SQL), then rebuilding its rollups")
        with psycopg.connect(f"{PG}/{CRUCIBLE_DB}", autocommit=True) as conn:
            conn.execute(
                "INSERT INTO metrics_metricpoint (run_id, name, step, value, wall_time) "
                "SELECT %s, 'layer' || lpad(s::text, 3, '0') || '/expert_load', g, "
                "sin(g / 5000.0 + s) + random() * 0.1, 1.7e9 + g "
                "FROM generate_series(0, %s - 1) AS s, generate_series(0, %s - 1) AS g",
                (uuid.UUID(run_id), WIDE_SERIES, WIDE_POINTS),
            )
        subprocess.run([sys.executable, str(ROOT / "manage.py"), "rebuild_metric_rollups",
                        "--run", run_id], env=self.env, cwd=ROOT, check=True,
                       capture_output=True)
        with psycopg.connect(f"{PG}/{CRUCIBLE_DB}", autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE metrics_metricrollup")
            conn.execute("VACUUM ANALYZE metrics_metricseries")
        times = []
        for i in range(2 + WIDE_READS):
            t = time.perf_counter()
            body = self.client.run_metrics(TEAM, run_id, max_points=1000, layout="columns")
            ms = (time.perf_counter() - t) * 1000
            series = body["series"]
            counts = {sum(s["columns"]["count"]) for s in series}
            if len(series) != WIDE_SERIES or counts != {WIDE_POINTS} or \
                    any(len(s["columns"]["step"]) != min(1000, WIDE_POINTS) for s in series):
                raise RuntimeError(f"wide read returned {len(series)} series covering "
                                   f"{sorted(counts)[:3]} points each")
            if i >= 2:
                times.append(ms)
        return times


def crucible_writer() -> None:
    """A Crucible writer process (``--writer``): claim a run, then post the batches."""
    cfg = json.loads(sys.stdin.readline())
    client = CrucibleClient(cfg["url"], cfg["token"], timeout=120,
                            metric_encoding=cfg.get("body", "msgpack"))
    worker_id = f"bench-{socket.gethostname()}-{os.getpid()}"
    session = client.claim("cpu", worker_id, run_id=cfg["run_id"])
    assert session is not None, "nothing to claim"
    session.start_heartbeat()
    names = cfg["names"]
    per_batch = cfg["batch_size"] // len(names)
    now = time.time()
    batches = []
    for b in range(cfg["batches"]):
        batch = []
        for i in range(per_batch):
            step = b * per_batch + i
            for k, name in enumerate(names):
                batch.append({"name": name, "step": step, "value": math.sin(step / 100.0 + k),
                              "wall_time": now + step / 1000.0})
        batches.append(batch)
    print("BENCH ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    start = time.perf_counter()
    stored = 0
    for batch in batches:
        stored += session.log_metrics(batch)["stored"]
    elapsed = time.perf_counter() - start
    session.stop_heartbeat()
    print("BENCH " + json.dumps({"points": stored, "elapsed": elapsed}), flush=True)


# --- concurrency and volume ---------------------------------------------------------------
class Concurrent:
    """CONCURRENT_POINTS points from CONCURRENT_CLIENTS writer processes
    (``tests.e2e.metric_writer``: the real client, one claimed run each) spread round-robin
    over CONCURRENT_WEBS web processes of their own (uvicorn, one worker each, own port),
    then counted in the database: lost (a (run, name, step) missing), duplicated (stored
    more than once) and wrong values. With ``restart``, once 40% of the batches are stored
    every web process is restarted: the first killed (SIGKILL: requests cut mid-transaction),
    the others stopped (SIGTERM), then all started again on their ports; the clients keep
    retrying each batch with its ``seq`` (their outbox) until a web answers."""

    def __init__(self, crucible: Crucible, procs: Processes) -> None:
        self.crucible, self.procs = crucible, procs
        self.ports = [free_port() for _ in range(CONCURRENT_WEBS)]
        self.webs: list[subprocess.Popen | None] = [None] * CONCURRENT_WEBS
        self.starts = 0

    def start_web(self, i: int) -> None:
        self.starts += 1
        self.webs[i] = self.procs.start(f"crucible-web{i}-{self.starts}", [
            sys.executable, "-m", "uvicorn", "config.asgi:application", "--host", "127.0.0.1",
            "--port", str(self.ports[i]), "--log-level", "warning", "--no-access-log",
        ], self.crucible.env)

    def wait_webs(self) -> None:
        for i, port in enumerate(self.ports):
            proc = self.webs[i]
            assert proc is not None
            wait_http(f"http://127.0.0.1:{port}/healthz", proc, f"crucible-web{i}")

    def setup(self) -> None:
        say(f"concurrent: starting {CONCURRENT_WEBS} web processes on ports {self.ports}")
        for i in range(CONCURRENT_WEBS):
            self.start_web(i)
        self.wait_webs()

    def restart(self) -> float:
        """Restart every web process; returns the seconds no web answered."""
        began = time.perf_counter()
        for i, proc in enumerate(self.webs):
            assert proc is not None
            if i == 0:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            else:
                self.procs.stop(proc)
        for i in range(CONCURRENT_WEBS):
            self.start_web(i)
        self.wait_webs()
        return time.perf_counter() - began

    def round(self, label: str, *, restart: bool) -> dict[str, Any]:
        names = NAMES
        per_client = CONCURRENT_POINTS // CONCURRENT_CLIENTS // len(names)  # steps
        points = per_client * len(names) * CONCURRENT_CLIENTS
        per_batch = max(1, CONCURRENT_BATCH // len(names))
        batches = CONCURRENT_CLIENTS * math.ceil(per_client / per_batch)
        run_ids = [self.crucible.launch(f"{label} c{i}") for i in range(CONCURRENT_CLIENTS)]
        configs = [{"url": f"http://127.0.0.1:{self.ports[i % CONCURRENT_WEBS]}",
                    "token": self.crucible.worker, "run_id": rid, "names": names,
                    "steps": per_client, "batch_size": CONCURRENT_BATCH, "body": BODY}
                   for i, rid in enumerate(run_ids)]
        say(f"{label}: {points:,} points ({batches:,} batches) from {CONCURRENT_CLIENTS} "
            f"clients over {CONCURRENT_WEBS} web processes" + (", restarting them once at 40%"
                                                               if restart else ""))
        env = {**self.crucible.env, "CRUCIBLE_VAR_DIR": str(BENCH_DIR / "writers")}
        env.pop("DATABASE_URL", None)  # clients hold no database credentials
        procs, logs = [], []
        downtime = None
        try:
            for i, cfg in enumerate(configs):
                log = open(LOGS / f"{label}-writer-{i}.log", "w")  # noqa: SIM115
                logs.append(log)
                proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.metric_writer"],
                                        env=env, cwd=ROOT, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=log, text=True,
                                        start_new_session=True)
                procs.append(proc)
                proc.stdin.write(json.dumps(cfg) + "\n")
                proc.stdin.flush()
            for i, proc in enumerate(procs):
                if _read_protocol(proc) != "ready":
                    raise RuntimeError(f"{label} writer {i} failed to start; see "
                                       f"{LOGS / f'{label}-writer-{i}.log'}")
            start = time.perf_counter()
            for proc in procs:
                proc.stdin.write("go\n")
                proc.stdin.flush()
            if restart:
                with psycopg.connect(f"{PG}/{CRUCIBLE_DB}", autocommit=True) as conn:
                    uuids = [uuid.UUID(r) for r in run_ids]
                    while True:
                        done = conn.execute("SELECT count(*) FROM metrics_metricbatch "
                                            "WHERE run_id = ANY(%s)", (uuids,)).fetchone()[0]
                        if done >= 0.4 * batches or any(p.poll() is not None for p in procs):
                            break
                        time.sleep(0.5)
                say(f"{label}: {done:,} of {batches:,} batches stored; restarting the web "
                    "processes")
                downtime = self.restart()
                say(f"{label}: web processes answer again after {downtime:.1f} s")
            results = []
            for i, proc in enumerate(procs):
                line = _read_protocol(proc)
                if not line or not line.startswith("{"):
                    raise RuntimeError(f"{label} writer {i} failed; see "
                                       f"{LOGS / f'{label}-writer-{i}.log'}")
                results.append(json.loads(line))
            elapsed = time.perf_counter() - start
        finally:
            for proc in procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
            for log in logs:
                log.close()
        sent = sum(r["points"] for r in results)
        if sent != points:
            raise RuntimeError(f"{label}: writers sent {sent} points, expected {points}")
        counted = count_points(run_ids, names, per_client)
        say(f"{label}: {points:,} points in {elapsed:.1f} s ({points / elapsed:,.0f} points/s); "
            f"in the database: {counted}; batches buffered by clients: "
            f"{sum(r['buffered'] for r in results)}")
        return {"rate": points / elapsed, "points": points, "elapsed": elapsed,
                "downtime": downtime, **counted}


def count_points(run_ids: list[str], names: list[str], steps: int) -> dict[str, int]:
    """What the database holds for these runs, against what was sent (every name at steps
    0..steps-1 in each run, value ``step + k / 1000`` for the k-th name): lost, duplicated,
    wrong values, and whether the series and batch bookkeeping agrees."""
    uuids = [uuid.UUID(r) for r in run_ids]
    expected = len(run_ids) * len(names) * steps
    with psycopg.connect(f"{PG}/{CRUCIBLE_DB}", autocommit=True) as conn:
        total, distinct, wrong = conn.execute(
            "SELECT count(*), count(DISTINCT (run_id, name, step)), count(*) FILTER (WHERE "
            "value <> step::float8 + (array_position(%(names)s::text[], name) - 1)::float8 "
            "/ 1000::float8 OR step >= %(steps)s) FROM metrics_metricpoint "
            "WHERE run_id = ANY(%(runs)s)",
            {"names": names, "steps": steps, "runs": uuids}).fetchone()
        series = conn.execute("SELECT coalesce(sum(count), 0) FROM metrics_metricseries "
                              "WHERE run_id = ANY(%s)", (uuids,)).fetchone()[0]
        batch_points = conn.execute("SELECT coalesce(sum(point_count), 0) FROM "
                                    "metrics_metricbatch WHERE run_id = ANY(%s)",
                                    (uuids,)).fetchone()[0]
    return {"lost": expected - distinct, "duplicated": total - distinct, "wrong": wrong,
            "series_off": int(series) - total, "batches_off": int(batch_points) - total}


# --- MLflow ---------------------------------------------------------------------------------
class MLflow:
    def __init__(self, procs: Processes) -> None:
        self.procs = procs
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.python = MLFLOW_VENV / "bin" / "python"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "MLFLOW_ENABLE_ASYNC_LOGGING": "false"}
        for var in ("DATABASE_URL", "REDIS_URL", "MLFLOW_TRACKING_URI", "DJANGO_SETTINGS_MODULE"):
            self.env.pop(var, None)

    def ensure_venv(self) -> None:
        mlflow = MLFLOW_VENV / "bin" / "mlflow"
        if mlflow.exists():
            return
        say(f"mlflow: creating {MLFLOW_VENV} and installing {MLFLOW_SPEC} psycopg2-binary "
            "(first run only; a few minutes)")
        subprocess.run(["python3", "-m", "venv", str(MLFLOW_VENV)], check=True)
        with open(LOGS / "mlflow-pip.log", "ab") as log:
            subprocess.run([str(MLFLOW_VENV / "bin" / "pip"), "install", "-q", MLFLOW_SPEC,
                            "psycopg2-binary"], check=True, stdout=log, stderr=subprocess.STDOUT)

    def setup(self) -> None:
        self.ensure_venv()
        version = subprocess.run(
            [str(self.python), "-c", "import mlflow; print(mlflow.__version__)"],
            env=self.env, check=True, capture_output=True, text=True,
        ).stdout.strip()
        say(f"mlflow {version}: database {MLFLOW_DB}, starting mlflow server --workers "
            f"{SERVER_WORKERS} on {self.url}")
        recreate_db(MLFLOW_DB)
        artifacts = BENCH_DIR / "mlflow-artifacts"
        artifacts.mkdir(parents=True, exist_ok=True)
        proc = self.procs.start("mlflow-server", [
            str(MLFLOW_VENV / "bin" / "mlflow"), "server",
            # Explicit driver: SQLAlchemy 2.1 defaults postgresql:// to psycopg 3.
            "--backend-store-uri",
            f"{PG}/{MLFLOW_DB}".replace("postgresql://", "postgresql+psycopg2://", 1),
            "--artifacts-destination", artifacts.as_uri(),
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", str(SERVER_WORKERS),
            # As the Crucible server runs (both are uvicorn with N workers).
            "--uvicorn-opts", f"--no-access-log --timeout-worker-healthcheck {HEALTHCHECK_S}",
        ], self.env)
        wait_http(f"{self.url}/health", proc, "mlflow-server", timeout=180)

    def ingest_round(self, r: int, batches: int = BATCHES) -> float:
        response = httpx.post(f"{self.url}/api/2.0/mlflow/experiments/create",
                              json={"name": f"ingest-r{r}-{uuid.uuid4().hex[:8]}"}, timeout=60)
        response.raise_for_status()
        experiment = response.json()["experiment_id"]
        configs = [{"tracking_uri": self.url, "experiment_id": experiment, "batches": batches,
                    "batch_size": BATCH_SIZE, "names": NAMES, "writer": i}
                   for i in range(WRITERS)]
        rate, results = run_writers("mlflow", [str(self.python), str(MLFLOW_WRITER)], self.env,
                                    configs)
        want = batches * BATCH_SIZE // len(NAMES)
        for res in results:  # stored, not just acknowledged
            history = httpx.get(f"{self.url}/api/2.0/mlflow/metrics/get-history",
                                params={"run_id": res["run_id"], "metric_key": NAMES[0],
                                        "max_results": want + 1}, timeout=60)
            history.raise_for_status()
            got = len(history.json().get("metrics", []))
            if got != want:
                raise RuntimeError(f"mlflow run {res['run_id']} holds {got} points of "
                                   f"{NAMES[0]}, expected {want}")
        return rate


# --- main -----------------------------------------------------------------------------------
def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # so the finally below stops the servers


def start_load(procs: Processes) -> None:
    """LOAD_PROCS busy loops at the lowest priority, for the whole run."""
    for i in range(LOAD_PROCS):
        procs.start(f"load-{i}", ["nice", "-n", "19", sys.executable, "-c",
                                  "while True: pass"], dict(os.environ))
    if LOAD_PROCS:
        say(f"background load: {LOAD_PROCS} nice -n 19 busy loops")


def _read_figures(reads: list[float], read_load: float, wide: list[float],
                  wide_load: float) -> None:
    print(f"read_1m_p95_ms: crucible={_pct(reads, 0.95):.1f} target=<=50 "
          f"median={statistics.median(reads):.1f} load={read_load:.1f}", flush=True)
    print(f"read_100x100k_ms: crucible={statistics.median(wide):.1f} target=<=300 "
          f"p95={_pct(wide, 0.95):.1f} series={WIDE_SERIES} points={WIDE_POINTS} "
          f"load={wide_load:.1f}", flush=True)



def main() -> int:
    LOGS.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    say(f"sections={','.join(sorted(SECTIONS))} writers={WRITERS} batches={BATCHES} x "
        f"{BATCH_SIZE} points repeats={REPEATS} reads={READS} read_points={READ_POINTS} "
        f"server_workers={SERVER_WORKERS} concurrent={CONCURRENT_POINTS:,} points from "
        f"{CONCURRENT_CLIENTS} clients over {CONCURRENT_WEBS} webs; logs in {LOGS}")
    procs = Processes()
    ours: list[float] = []
    theirs: list[float] = []
    copies: list[float] = []
    loads: list[float] = []
    reads: list[float] = []
    wide: list[float] = []
    read_load = wide_load = 0.0
    rounds: dict[str, dict[str, Any]] = {}
    try:
        start_load(procs)
        crucible = Crucible(procs)
        crucible.setup()
        if "ingest" in SECTIONS:
            mlflow = MLflow(procs)
            mlflow.setup()
            # A short warm-up on each side (lazy imports, connections in both server workers).
            say("warm-up: one batch per writer on each side, not counted")
            crucible.ingest_round(-1, batches=1)
            mlflow.ingest_round(-1, batches=1)
            sides = {"crucible": (crucible, ours), "mlflow": (mlflow, theirs)}
            for r in range(REPEATS):
                order = ["crucible", "mlflow"] if r % 2 == 0 else ["mlflow", "crucible"]
                for side in order:
                    server, rates = sides[side]
                    rate = server.ingest_round(r)
                    rates.append(rate)
                    say(f"repeat {r + 1}/{REPEATS} {side}: {rate:,.0f} points/s "
                        f"({WRITERS * BATCHES * BATCH_SIZE:,} points)")
                copies.append(crucible.copy_round(r))
                loads.append(os.getloadavg()[0])
                say(f"repeat {r + 1}/{REPEATS} raw COPY: {copies[-1]:,.0f} points/s "
                    f"(load average {loads[-1]:.1f})")
        if "read" in SECTIONS:
            reads = crucible.read_1m()
            read_load = os.getloadavg()[0]
            say(f"read {READ_POINTS:,} points: median {statistics.median(reads):.1f} ms, "
                f"p95 {_pct(reads, 0.95):.1f} ms, max {max(reads):.1f} ms over "
                f"{len(reads)} GETs")
            wide = crucible.read_wide()
            wide_load = os.getloadavg()[0]
            say(f"read {WIDE_SERIES} x {WIDE_POINTS:,} points: median "
                f"{statistics.median(wide):.1f} ms, p95 {_pct(wide, 0.95):.1f} ms over "
                f"{len(wide)} GETs")
        if SECTIONS & {"concurrent", "restart"}:
            concurrent = Concurrent(crucible, procs)
            concurrent.setup()
            for section, label, restart in (("concurrent", "ingest_concurrent_10m", False),
                                            ("restart", "ingest_concurrent_restart", True)):
                if section in SECTIONS:
                    rounds[label] = concurrent.round(label, restart=restart)
                    rounds[label]["load"] = os.getloadavg()[0]
    finally:
        procs.stop_all()
        if not KEEP_DB:
            drop_db(CRUCIBLE_DB)
            if "ingest" in SECTIONS:
                drop_db(MLFLOW_DB)
    # load= is the 1-minute load average the figure was measured at (median over repeats):
    # the machine is shared, and the targets are set at a load average of 4.
    if ours:
        c, m = statistics.median(ours), statistics.median(theirs)
        limit = statistics.median(copies)
        load = statistics.median(loads)
        print(f"ingest: crucible={c:.0f} mlflow={m:.0f} ratio={c / m:.2f} target=>=10 "
              f"body={BODY} load={load:.1f}", flush=True)
        print(f"ingest_vs_copy: crucible={c:.0f} copy={limit:.0f} ratio={c / limit:.2f} "
              f"target=>=0.5 body={BODY} load={load:.1f}", flush=True)
    if reads:
        _read_figures(reads, read_load, wide, wide_load)
    for label, res in rounds.items():
        extra = f" web_down_s={res['downtime']:.1f}" if res["downtime"] is not None else ""
        print(f"{label}: crucible={res['rate']:.0f} lost={res['lost']} "
              f"duplicated={res['duplicated']} target=lost==0,duplicated==0 "
              f"points={res['points']} clients={CONCURRENT_CLIENTS} webs={CONCURRENT_WEBS} "
              f"batch={CONCURRENT_BATCH} wrong={res['wrong']} body={BODY}{extra} "
              f"load={res['load']:.1f}", flush=True)
    bad = [label for label, res in rounds.items()
           if res["lost"] or res["duplicated"] or res["wrong"] or res["series_off"]
           or res["batches_off"]]
    if bad:
        say(f"FAILED: {', '.join(bad)} lost, duplicated or miscounted points: "
            f"{ {label: rounds[label] for label in bad} }")
        return 1
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--writer"]:
        crucible_writer()
    else:
        sys.exit(main())
