"""Executions through the API, run by a real Celery worker on the ``sandbox`` queue in a
real sandbox (bubblewrap + seccomp + cgroup)."""

from __future__ import annotations

import os
import shutil

import pytest

from apps.core.actor import Actor
from apps.teams.models import Role
from apps.teams.services import personal_token_create, worker_token_create
from tests.factories import MembershipFactory, TeamFactory, UserFactory
from tests.skips import host_reason
from workers.client import CrucibleClient

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(os.geteuid() != 0, reason=host_reason("the sandbox pool runs as root")),
    pytest.mark.skipif(not shutil.which("bwrap"),
                       reason="the sandbox needs bubblewrap "
                              "(bash scripts/install_sandbox_deps.sh)"),
]


def test_sync_and_batch_executions_through_a_sandbox_worker(live_server, start_worker):
    user = UserFactory(username="coder")
    team = TeamFactory(slug="code")
    MembershipFactory(team=team, user=user, role=Role.MEMBER)
    _, token = personal_token_create(actor=Actor.of_user(user), user=user, name="t")
    _, worker_token = worker_token_create(actor=Actor.system(), team=None, name="sandbox")
    start_worker(worker_token, queues="sandbox")
    with CrucibleClient(live_server.url, token) as client:
        one = client.request("POST", "teams/code/executions", json={
            "language": "python", "stdin": "2 3 4", "wait": 60,
            "code": "import sys; print(sum(map(int, sys.stdin.read().split())))"})
        assert one["status"] == "done", one
        assert one["result"]["status"] == "OK" and one["result"]["stdout"] == "9\n"

        requests = [
            {"language": "python", "code": "while True: pass",
             "limits": {"wall_ms": 1000, "cpu_ms": 500}},
            {"language": "python", "code": "print(input()[::-1])",
             "cases": [{"stdin": "abc\n", "expected_stdout": "cba\n"},
                       {"stdin": "xy\n", "expected_stdout": "nope\n"}]},
            {"language": "python",
             "code": "import socket; socket.create_connection(('127.0.0.1', 5432))"},
        ]
        batch = client.request("POST", "teams/code/executions/batch",
                               json={"wait": 60, "requests": requests})
        statuses = [r["status"] for r in batch["results"]]
        assert statuses == ["done", "done", "done"], batch
        loop, cases, net = (r["result"] for r in batch["results"])
        assert loop["status"] == "TLE"
        assert [c["passed"] for c in cases["cases"]] == [True, False]
        assert net["status"] == "RE"  # no network inside the sandbox
