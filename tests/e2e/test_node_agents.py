"""Two real node agents (``python -m workers.agent``, 2 fake GPUs each) against a live
server: both register and heartbeat; one is killed and goes lost at the next sweep while the
other stays ready; the survivor stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from apps.core.actor import Actor
from apps.scheduling.models import Node
from apps.teams.services import worker_token_create
from tests.e2e.conftest import ROOT, wait_for

pytestmark = pytest.mark.slow


def start_agent(url: str, token: str, name: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "CRUCIBLE_API_URL": url, "CRUCIBLE_WORKER_TOKEN": token,
           "CRUCIBLE_NODE_NAME": name, "CRUCIBLE_FAKE_GPUS": "2",
           "CRUCIBLE_GPU_TYPE": "fake-A100", "CRUCIBLE_NODE_LABELS": f"rack={name[-1]}",
           "CRUCIBLE_NODE_HEARTBEAT_S": "0.3", "PYTHONUNBUFFERED": "1"}
    env.pop("DATABASE_URL", None)  # agents hold no database credentials
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "workers.agent"], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)


def heartbeats_after_registering(name: str) -> bool:
    node = Node.objects.filter(name=name).first()
    return node is not None and node.last_heartbeat_at > node.registered_at


def test_two_agents_register_heartbeat_and_a_killed_one_goes_lost(live_server, settings,
                                                                   tmp_path):
    settings.CRUCIBLE = {**settings.CRUCIBLE, "NODE_LOST_AFTER_S": 4}
    _, token = worker_token_create(actor=Actor.system(), team=None, name="agents")
    logs = {n: tmp_path / f"{n}.log" for n in ("node-a", "node-b")}
    agents = {n: start_agent(live_server.url, token, n, log) for n, log in logs.items()}
    try:
        for name in agents:
            wait_for(lambda n=name: heartbeats_after_registering(n), timeout=60,
                     what=f"{name} to register and heartbeat ({logs[name]})")
        nodes = {n.name: n for n in Node.objects.all()}
        assert set(nodes) == {"node-a", "node-b"}
        assert all((n.pool, n.gpu_type, n.gpu_count, n.state) == ("gpu", "fake-A100", 2, "ready")
                   for n in nodes.values())
        assert nodes["node-b"].labels == {"rack": "b"} and nodes["node-a"].cpus >= 1
        assert nodes["node-a"].memory_mb > 0

        agents["node-a"].send_signal(signal.SIGKILL)
        agents["node-a"].wait(timeout=10)
        sweep = httpx.Client(base_url=live_server.url,
                             headers={"Authorization": f"Bearer {token}"})

        def swept_lost() -> bool:
            answer = sweep.post("/api/v1/worker/sweep").json()
            return "node-a" in answer["nodes_lost"]

        wait_for(swept_lost, timeout=30, what="the sweep to find node-a lost")
        states = dict(Node.objects.values_list("name", "state"))
        assert states == {"node-a": "lost", "node-b": "ready"}
        assert "no heartbeat for" in Node.objects.get(name="node-a").state_reason

        agents["node-b"].send_signal(signal.SIGTERM)
        assert agents["node-b"].wait(timeout=20) == 0
        log_b = logs["node-b"].read_text()
        assert "registered node node-b: pool gpu, 2 x fake-A100 GPU" in log_b
        assert "node agent node-b stopping" in log_b and "Traceback" not in log_b
    finally:
        for proc in agents.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
