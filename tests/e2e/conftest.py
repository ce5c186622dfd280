"""Real processes: a Celery worker subprocess talking to a live server over HTTP."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings

from config.celery import QUEUES, app

# Each test's own object store, cache namespace and fast hasher, as in tests/apps.
from tests.django_fixtures import (  # noqa: F401 - autouse fixtures, found by name
    fast_password_hashing,
    isolated_cache,
    object_store,
)

ROOT = Path(__file__).resolve().parents[2]


def purge_queues() -> None:
    """Drop messages left by earlier runs so the worker sees only this test's work."""
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        for queue in QUEUES:
            # A queue that was never declared has nothing to purge.
            with contextlib.suppress(Exception):
                channel.queue_purge(queue)


@pytest.fixture
def start_worker(live_server):
    procs: list[subprocess.Popen] = []

    def start(worker_token: str, queues: str = "cpu", extra_env: dict | None = None,
              log: Path | None = None, beat: Path | None = None,
              pool: tuple[str, ...] = ("-P", "solo")) -> subprocess.Popen:
        """A worker process; ``log``: write its output to that file instead of a pipe (a
        chatty worker would fill the pipe and block); ``beat``: also run the beat (lease
        sweeps) in it, keeping its schedule in that file; ``pool``: its pool options (one
        process by default)."""
        env = {
            **os.environ,
            "CRUCIBLE_API_URL": live_server.url,
            "CRUCIBLE_WORKER_TOKEN": worker_token,
            "OBJECT_STORE_URL": settings.OBJECT_STORE_URL,
            "PYTHONUNBUFFERED": "1",
            **(extra_env or {}),
        }
        env.pop("DATABASE_URL", None)  # workers hold no database credentials
        command = [sys.executable, "-m", "celery", "-A", "config.celery", "worker", "-Q", queues,
                   *pool, "--without-gossip", "--without-mingle", "--without-heartbeat",
                   "--loglevel", "INFO"]
        if beat is not None:
            command += ["-B", "-s", str(beat)]
        output = log.open("ab") if log is not None else subprocess.PIPE
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=output,
                                stderr=subprocess.STDOUT, text=log is None)
        if log is not None:
            output.close()  # the child holds its own descriptor
        procs.append(proc)
        return proc

    purge_queues()
    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_for(predicate, timeout: float = 90, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def tenant(slug: str = "e2e") -> tuple[str, str]:
    """A member ``slug`` of team ``slug`` with project ``demo``: the member's API token and an
    operator worker token (not tied to a team), as a pool on another host would hold."""
    from apps.core.actor import Actor
    from apps.teams.models import Role
    from apps.teams.services import personal_token_create, worker_token_create
    from tests.factories import MembershipFactory, ProjectFactory, TeamFactory, UserFactory

    user = UserFactory(username=slug)
    team = TeamFactory(slug=slug)
    MembershipFactory(team=team, user=user, role=Role.MEMBER)
    ProjectFactory(team=team, slug="demo")
    _, token = personal_token_create(actor=Actor.of_user(user), user=user, name=slug)
    _, worker_token = worker_token_create(actor=Actor.system(), team=None, name="pool")
    return token, worker_token
