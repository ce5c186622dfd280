"""A bounded schemathesis run against a real Crucible web process (`make api-fuzz`, CI).

Seeds a fresh database (SQLite under a temporary folder, or, when DATABASE_URL names
PostgreSQL, a fresh database beside it), starts uvicorn on it, and runs schemathesis
against the served OpenAPI document with a fixed seed and a bounded number of examples per
operation, twice: as a team owner (personal token) and as a team's worker token. Passes
only with 0 server errors and 0 schema violations (undocumented status codes, responses
that do not match their schema, wrong content types).

Environment: DATABASE_URL, REDIS_URL as for the suite; API_FUZZ_EXAMPLES (default 8),
API_FUZZ_SEED (default 20261203), API_FUZZ_PHASES (default examples,coverage,fuzzing),
API_FUZZ_PATHS (a path regex: fuzz only those operations, as the owner, e.g. ``/capacity``
while working on one endpoint; unset: everything).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_schema_conformance")

SEED = """
import json
import django
django.setup()
from apps.core.actor import Actor
from apps.datasets import services as datasets
from apps.environments import services as environments
from apps.projects import services as projects
from apps.runs.launch import run_launch
from apps.teams import services as teams
from django.contrib.auth import get_user_model

user = get_user_model().objects.create_user("fuzzer", password="fuzz-pw-1")
actor = Actor.of_user(user)
team = teams.team_create(actor=actor, slug="fuzz", name="Fuzz")
project = projects.project_create(actor=actor, team=team, slug="main")
dataset = datasets.dataset_create(actor=actor, team=team, project=project, slug="qa")
version, _ = datasets.version_create(actor=actor, dataset=dataset, records=[
    {"prompt": f"{i} + {i} =", "answer": str(2 * i)} for i in range(20)])
env = environments.environment_create(actor=actor, team=team, project=project, slug="arith")
environments.version_register(actor=actor, environment=env, spec={
    "env": {"source": "builtin", "name": "arithmetic", "params": {"eval_size": 4}}})
run = run_launch(actor=actor, team=team, document={
    "project": "main", "kind": "profile", "config": {}, "datasets": ["qa"]}).run
_, token = teams.personal_token_create(actor=actor, user=user, name="fuzz")
_, worker = teams.worker_token_create(actor=actor, team=team, name="fuzz-pool")
print(json.dumps({"token": token, "worker": worker, "run": str(run.pk),
                  "digest": version.digest}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(proc: subprocess.Popen[bytes], address: tuple[str, int]) -> bool:
    """Wait up to 60 s for ``proc`` to accept connections on ``address``."""
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(address, timeout=1).close()
            return True
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.3)


def _fresh_postgres(url: str) -> str:
    """A new, empty database next to the one DATABASE_URL names (dropped first)."""
    import psycopg

    parts = urlsplit(url)
    name = f"{parts.path.lstrip('/') or 'crucible'}_apifuzz"
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return urlunsplit(parts._replace(path=f"/{name}"))


def _env(var: Path) -> dict[str, str]:
    # The sandbox-session routes call a session host: the fuzz runs a real one (started in
    # main) rather than let every session call answer 503.
    host = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "CRUCIBLE_SESSION_HOST_URL": f"http://{host}",
           "CRUCIBLE_SESSION_HOST_BIND": host,
           "CRUCIBLE_SESSION_HOST_TOKEN": secrets.token_hex(16),
           "CRUCIBLE_VAR_DIR": str(var), "OMP_NUM_THREADS": "1",
           "DJANGO_SETTINGS_MODULE": "config.settings", "LOG_LEVEL": "WARNING",
           # Runs launched by the fuzzer queue in a spool nobody consumes.
           "CELERY_BROKER_URL": "filesystem://",
           # The fuzzer is one client sending thousands of requests: lift the per-token
           # rates (the throttles have their own tests), keep everything else as shipped.
           "CRUCIBLE_THROTTLE_USER": "1000000/min", "CRUCIBLE_THROTTLE_WORKER": "1000000/min",
           "CRUCIBLE_THROTTLE_ANON": "1000000/min",
           "CRUCIBLE_THROTTLE_AUTH_FAILURE": "1000000/min"}
    database = os.environ.get("DATABASE_URL", "")
    if database.startswith(("postgres://", "postgresql://")):
        env["DATABASE_URL"] = _fresh_postgres(database)
    else:
        env["DATABASE_URL"] = f"sqlite:///{var / 'fuzz.sqlite3'}"
    return env


def _config(ids: dict[str, str], folder: Path) -> Path:
    """Path parameters pinned to the seeded objects, so operations reach their logic instead
    of stopping at 404 (values the fuzzer invents for the other parameters still probe the
    lookups)."""
    pinned = {"team": "fuzz", "project": "main", "dataset": "qa", "environment": "arith",
              "version": "v1", "run": ids["run"]}
    lines = ["[parameters]", *(f'"path.{k}" = "{v}"' for k, v in pinned.items())]
    path = folder / "schemathesis.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _schemathesis(base: str, header: str, label: str, report: Path, extra: list[str],
                  config: Path) -> int:
    examples = os.environ.get("API_FUZZ_EXAMPLES", "8")
    seed = os.environ.get("API_FUZZ_SEED", "20261203")
    phases = os.environ.get("API_FUZZ_PHASES", "examples,coverage,fuzzing")
    command = [
        str(Path(sys.executable).with_name("schemathesis")), "--config-file", str(config),
        "run", f"{base}/api/v1/schema",
        "--checks", CHECKS, "--seed", seed, "--max-examples", examples, "--phases", phases,
        "--workers", "1", "--request-timeout", "60", "--no-color",
        "--generation-database", "none",
        "--suppress-health-check", "all",
        "-H", header, "--report", "junit",
        "--report-junit-path", str(report / f"{label}.xml"), *extra,
    ]
    print(f"\n=== schemathesis as {label} (seed {seed}, {examples} examples/operation) ===",
          flush=True)
    started = time.monotonic()
    code = subprocess.call(command, cwd=config.parent)  # its cache stays in the temp folder
    print(f"=== {label}: exit {code} after {time.monotonic() - started:.0f} s ===", flush=True)
    return code


def main() -> int:
    var = Path(tempfile.mkdtemp(prefix="crucible-apifuzz-"))
    env = _env(var)
    web: subprocess.Popen[bytes] | None = None
    host: subprocess.Popen[bytes] | None = None
    try:
        host = subprocess.Popen([sys.executable, "-m", "workers.sandbox.session_host",
                                 "--bind", env["CRUCIBLE_SESSION_HOST_BIND"]], cwd=ROOT,
                                env=env)
        subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env,
                       check=True)
        seeded = subprocess.run([sys.executable, "-c", SEED], cwd=ROOT, env=env, check=True,
                                capture_output=True, text=True)
        ids = json.loads(seeded.stdout.strip().splitlines()[-1])
        port = _free_port()
        web = subprocess.Popen([sys.executable, "-m", "uvicorn", "config.asgi:application",
                                "--port", str(port), "--log-level", "warning"], cwd=ROOT,
                               env=env)
        for proc, at, name in ((web, ("127.0.0.1", port), "the web process"),
                               (host, env["CRUCIBLE_SESSION_HOST_BIND"].split(":"),
                                "the session host")):
            if not _listening(proc, (at[0], int(at[1]))):
                print(f"{name} did not start", file=sys.stderr)
                return 1
        base = f"http://127.0.0.1:{port}"
        report = ROOT / "var" / "api-fuzz"
        report.mkdir(parents=True, exist_ok=True)
        config = _config(ids, var)
        only = os.environ.get("API_FUZZ_PATHS", "").strip()
        owner = _schemathesis(base, f"Authorization: Bearer {ids['token']}", "owner", report,
                              ["--exclude-path-regex", "^/api/v1/worker/",
                               *(["--include-path-regex", only] if only else [])], config)
        worker = 0 if only else _schemathesis(
            base, f"Authorization: Bearer {ids['worker']}", "worker", report,
            ["--include-path-regex", "^/api/v1/worker/"], config)
        failed = [name for name, code in (("owner", owner), ("worker", worker)) if code]
        print("api-fuzz: " + ("FAILED (" + ", ".join(failed) + ")" if failed
                              else "0 server errors, 0 schema violations"))
        return 1 if failed else 0
    finally:
        # SIGINT for the host: it closes its sessions and unmounts their layers on the way out.
        for child, sig in ((web, signal.SIGTERM), (host, signal.SIGINT)):
            if child is not None:
                child.send_signal(sig)
                try:
                    child.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    child.kill()
        shutil.rmtree(var, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
