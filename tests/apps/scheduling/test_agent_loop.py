"""The agent's loop against the real worker API in-process: it registers, heartbeats,
follows the state an admin set, and registers again when the web has marked it lost or
forgotten it."""

from __future__ import annotations

import logging

import pytest

from apps.core.actor import Actor
from apps.scheduling import services
from apps.scheduling.models import Node
from workers.agent import Agent, describe_host

ENV = {"CRUCIBLE_NODE_NAME": "box-1", "CRUCIBLE_FAKE_GPUS": "2", "CRUCIBLE_GPU_TYPE": "L4"}


@pytest.fixture
def agent(pool) -> Agent:
    return Agent(pool, describe_host(ENV), interval=0.1)


def test_register_then_heartbeat_then_follow_a_cordon(agent, caplog):
    caplog.set_level(logging.INFO, logger="crucible.agent")
    agent.beat_once()
    node = Node.objects.get()
    assert (node.name, node.gpu_count, node.gpu_type, agent.state) == ("box-1", 2, "L4", "ready")
    registered_at = node.registered_at
    agent.beat_once()
    node.refresh_from_db()
    assert node.registered_at == registered_at and node.last_heartbeat_at > registered_at
    services.cordon(actor=Actor.system(), node=node, reason="maintenance")
    agent.beat_once()
    assert agent.state == "cordoned"
    assert "node box-1: ready -> cordoned (maintenance)" in caplog.text


def test_a_lost_node_registers_again(agent, settings):
    agent.beat_once()
    settings.CRUCIBLE = {**settings.CRUCIBLE, "NODE_LOST_AFTER_S": 0}
    assert services.sweep_lost_nodes() == ["box-1"]
    agent.beat_once()  # the heartbeat answers lost: the agent registers in the same beat
    assert Node.objects.get().state == "ready" and agent.state == "ready"


def test_a_forgotten_node_registers_again(agent):
    agent.beat_once()
    Node.objects.all().delete()  # e.g. the web came back on a fresh database
    agent.beat_once()
    assert Node.objects.filter(name="box-1").exists()


def test_a_team_token_stops_the_agent(wsgi, team):
    from apps.teams.services import worker_token_create
    from workers.client import CrucibleClient

    _, raw = worker_token_create(actor=Actor.system(), team=team, name="team-pool")
    with (CrucibleClient("http://testserver", raw, transport=wsgi, retries=0) as client,
          pytest.raises(SystemExit, match="operator worker tokens")):
        Agent(client, describe_host(ENV), interval=0.1).run()


def test_the_agent_probes_its_sandbox_and_rechecks_when_asked(pool, caplog):
    """Real probes of this host's sandbox: reported in the next heartbeat; a run's failed
    probe asks for a re-check, which the agent answers by rebuilding and probing again."""
    from tests.skips import sandbox_unavailable

    if reason := sandbox_unavailable():
        pytest.skip(reason)
    caplog.set_level(logging.INFO)
    agent = Agent(pool, describe_host(ENV), interval=0.1, probe=("python",))
    agent.beat_once()  # registers
    agent.beat_once()  # probes python (due at once) and reports it
    node = Node.objects.get()
    assert node.toolchains["python"]["ok"] is True and node.recheck == []
    services.record_toolchain_failure(
        node="box-1", toolchains={"python": {"ok": False, "detail": "bwrap missing"}},
        run_id="r1")
    agent.beat_once()  # the answer asks for a re-check: rebuild, probe
    node.refresh_from_db()
    assert node.recheck == ["python"] and node.broken_languages() == {"python"}
    assert "sandbox state cleared" in caplog.text
    agent.beat_once()  # reports what it found
    node.refresh_from_db()
    assert node.recheck == [] and node.broken_languages() == frozenset()
