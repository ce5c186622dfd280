"""A run whose environment's sandbox is really broken on its node (the worker's bubblewrap
points at a missing binary) never starts: the worker's health probe fails, it reports an
``environment`` failure, the control plane queues the run again and counts the failure
against the node, and after ``max_attempts`` the run fails saying why. The node is asked to
re-check: its real agent (whose sandbox works) rebuilds, probes and reports python healthy
again in its heartbeat."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from apps.runs.models import RunAttempt
from apps.scheduling.models import Node
from tests.e2e.conftest import ROOT, tenant, wait_for
from workers.client import CrucibleClient

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ENVS = "teams/e2e/environments"
CODE = {"source": "builtin", "name": "code"}  # unit tests in the python sandbox


def start_agent(url: str, token: str, name: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "CRUCIBLE_API_URL": url, "CRUCIBLE_WORKER_TOKEN": token,
           "CRUCIBLE_NODE_NAME": name, "CRUCIBLE_NODE_POOL": "cpu",
           "CRUCIBLE_NODE_HEARTBEAT_S": "0.3", "CRUCIBLE_NODE_PROBE": "none",
           "PYTHONUNBUFFERED": "1"}
    env.pop("DATABASE_URL", None)
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "workers.agent"], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)


def test_a_broken_sandbox_requeues_counts_on_the_node_and_the_agent_rechecks(
        live_server, start_worker, settings, tmp_path: Path) -> None:
    settings.CRUCIBLE = {**settings.CRUCIBLE, "MAX_ATTEMPTS": 2}
    token, worker_token = tenant()
    name = f"env-{uuid.uuid4().hex[:8]}"
    agent = start_agent(live_server.url, worker_token, name, tmp_path / "agent.log")
    try:
        wait_for(lambda: Node.objects.filter(name=name).exists(), timeout=60,
                 what=f"agent {name} to register")
        log = tmp_path / "worker.log"
        start_worker(worker_token, queues="sandbox", log=log, extra_env={
            "CRUCIBLE_NODE_NAME": name,
            "CRUCIBLE_SANDBOX_BWRAP": str(tmp_path / "no-such-bwrap")})
        with CrucibleClient(live_server.url, token) as client:
            client.request("POST", ENVS, json={"slug": "code", "project": "demo"})
            version = client.request("POST", f"{ENVS}/code/versions", json={"spec": CODE})
            qc = client.request("POST", f"{ENVS}/code/versions/{version['digest']}/qc",
                                json={})
            try:
                done = client.wait_for_run("e2e", qc["id"], timeout=180)
            except TimeoutError:
                raise AssertionError(log.read_text()[-4000:]) from None
            events = [e["message"] for e in client.run_events("e2e", qc["id"])["results"]]
        assert done["status"] == "failed"
        assert "no-such-bwrap is missing" in done["error"]
        assert "the sandbox cannot run python on node " + name in done["error"]
        assert "gave up after 2 of 2 attempts" in done["error"]
        assert done["started_at"] is None  # the engine never ran: the probe stopped it first
        assert f"queued: attempt 1 failed (environment broken on node {name}); retrying " \
               "(attempt 2 of 2)" in events, events
        attempts = RunAttempt.objects.filter(run_id=qc["id"]).order_by("number")
        assert [a.outcome for a in attempts] == ["failed", "failed"]
        node = Node.objects.get(name=name)
        assert node.consecutive_infra_failures == 2
        # The run's failure asked the node to re-check; its agent's sandbox works, so it
        # rebuilds, probes and reports python healthy, which clears the request.

        def rechecked() -> bool:
            node.refresh_from_db()
            python = node.toolchains.get("python", {})
            return node.recheck == [] and python.get("ok") is True \
                and python.get("source") == "agent"

        wait_for(rechecked, timeout=60, what=f"agent {name} to re-check python")
        assert "sandbox state cleared" in (tmp_path / "agent.log").read_text()
    finally:
        agent.terminate()
        agent.wait(timeout=20)
