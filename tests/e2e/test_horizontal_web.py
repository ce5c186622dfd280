"""Horizontal web (issue 21, item 7): two web processes (uvicorn) on two ports share
PostgreSQL and the Redis channel layer. A websocket client on one sees, live and in order,
the events a worker writes through the other. PostgreSQL + Redis only: the embedded default
runs one web process with an in-memory channel layer."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
from django.conf import settings

from apps.core.actor import Actor
from apps.teams.models import Role
from apps.teams.services import personal_token_create, worker_token_create
from tests.e2e.conftest import purge_queues
from tests.e2e.faults import Processes, processes_fixture  # noqa: F401 - the fixture
from tests.factories import MembershipFactory, ProjectFactory, TeamFactory, UserFactory
from tests.skips import host_skip
from workers.client import CrucibleClient

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(300)]


def test_a_websocket_on_one_web_process_sees_events_written_through_the_other(
        processes: Processes) -> None:
    if settings.DATABASES["default"]["ENGINE"].endswith("sqlite3") or \
            not os.environ.get("REDIS_URL"):
        host_skip("two web processes share PostgreSQL and the Redis channel layer: the "
                  "PostgreSQL + Redis pass runs this (the embedded default is one process)")
    purge_queues()
    user = UserFactory(username="hz")
    team = TeamFactory(slug="hz")
    MembershipFactory(team=team, user=user, role=Role.MEMBER)
    ProjectFactory(team=team, slug="demo")
    _, token = personal_token_create(actor=Actor.of_user(user), user=user, name="hz")
    _, worker_token = worker_token_create(actor=Actor.system(), team=None, name="pool")

    web_a = processes
    web_a.start_web()
    web_b = web_a.another_web()
    assert web_a.url != web_b.url
    with CrucibleClient(web_a.url, token) as on_a, CrucibleClient(web_b.url, token) as on_b, \
            CrucibleClient(web_b.url, worker_token) as pool_b:
        on_b.create_dataset("hz", "qa", "demo")
        on_b.upload_version("hz", "qa", [{"q": i} for i in range(5)])
        rid = on_b.launch_run("hz", project="demo", kind="profile", datasets=["qa"])["id"]
        first = on_a.run_events("hz", rid)["results"]
        # One message to replay, so the listener knows its socket is open and caught up:
        # everything after it can reach web A's socket only live, through Redis.
        after = max(e["seq"] for e in first) - 1

        seen: list[dict[str, Any]] = []
        failed: list[BaseException] = []
        opened = threading.Event()

        def listen() -> None:
            try:
                for message in on_a.stream("hz", rid, after=after, timeout=60):
                    opened.set()
                    seen.append(message)
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                failed.append(exc)

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        assert opened.wait(60), failed
        # Everything below goes through web B; the stream is web A's.
        session = pool_b.claim("cpu", "hz-worker", run_id=rid)
        assert session is not None
        session.set_status("running")
        for i in range(3):
            session.log_event(f"through web B #{i}")
        session.log_metrics([{"name": "loss", "step": s, "value": 1.0 / (s + 1)}
                             for s in range(4)])
        session.set_status("succeeded")
        listener.join(timeout=90)
        assert not listener.is_alive() and not failed, failed
    seqs = [m["seq"] for m in seen]
    assert seqs == list(range(after + 1, after + 1 + len(seqs)))  # in order, no gap
    messages = [m.get("message") for m in seen if m["type"] == "event"]
    assert [m for m in messages if m and m.startswith("through web B")] == [
        f"through web B #{i}" for i in range(3)]
    assert any(m["type"] == "metrics" and m["steps"] == [0, 1, 2, 3] for m in seen)
    statuses = [m["data"]["status"] for m in seen if m["type"] == "event"
                and m["kind"] == "status"]
    assert statuses[-1] == "succeeded" and "running" in statuses
