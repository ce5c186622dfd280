"""The inventory's rules, through the services with a controlled clock: registration is
idempotent by name, silent nodes go lost at the sweep and come back in the state an admin
left them, the lemon rule cordons after N infrastructure failures in a row, and every change
leaves a transition row and an audit row."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from apps.core.actor import Actor
from apps.core.exceptions import IllegalTransition, InvalidInput, NotFound
from apps.core.models import AuditLog
from apps.scheduling import services
from apps.scheduling.models import Node, NodeState, NodeTransition
from workers.protocol import NodeRegistration

pytestmark = pytest.mark.django_db


def t(seconds: float) -> datetime:
    return datetime(2026, 12, 4, 12, 0, tzinfo=timezone.get_default_timezone()) + \
        timedelta(seconds=seconds)


def reg(name: str = "gpu-a1", **overrides) -> NodeRegistration:
    doc = {"name": name, "pool": "gpu", "gpu_type": "H100", "gpu_count": 8, "cpus": 64,
           "memory_mb": 512_000, "labels": {"zone": "a"}, "agent_version": "0.1.0",
           **overrides}
    return NodeRegistration.model_validate(doc)


AGENT = Actor.of_worker("crw_test", "agent")
ADMIN = Actor(label="ops-alice")


def states(node: Node) -> list[tuple[str, str]]:
    return [(r.from_state, r.to_state) for r in NodeTransition.objects.filter(node=node)]


def test_register_is_idempotent_by_name_and_updates_capacity():
    first, created = services.register_node(actor=AGENT, registration=reg(), now=t(0))
    assert created and first.state == NodeState.READY and first.gpu_count == 8
    again, created = services.register_node(
        actor=AGENT, registration=reg(gpu_count=4, labels={"zone": "b"}), now=t(5))
    assert not created and again.pk == first.pk
    assert Node.objects.count() == 1
    again.refresh_from_db()
    assert (again.gpu_count, again.labels, again.last_heartbeat_at) == (4, {"zone": "b"}, t(5))
    rows = list(AuditLog.objects.filter(action="node.register").order_by("id"))
    assert [r.data["created"] for r in rows] == [True, False]
    assert rows[1].data["changed"] == ["gpu_count", "labels"]
    assert rows[1].actor_label == "worker:crw_test/agent" and rows[1].team_id is None


def test_heartbeat_of_an_unknown_node_says_register_first():
    with pytest.raises(NotFound, match="register it first"):
        services.heartbeat(name="ghost", now=t(0))


def test_sweep_marks_silent_nodes_lost_with_a_controlled_clock(settings):
    settings.CRUCIBLE = {**settings.CRUCIBLE, "NODE_LOST_AFTER_S": 30}
    quiet, _ = services.register_node(actor=AGENT, registration=reg("quiet"), now=t(0))
    chatty, _ = services.register_node(actor=AGENT, registration=reg("chatty"), now=t(0))
    services.heartbeat(name="chatty", now=t(25))
    assert services.sweep_lost_nodes(now=t(30)) == []  # 30 s is not older than 30 s
    assert services.sweep_lost_nodes(now=t(31)) == ["quiet"]
    quiet.refresh_from_db()
    chatty.refresh_from_db()
    assert quiet.state == NodeState.LOST and chatty.state == NodeState.READY
    assert quiet.state_reason.startswith("no heartbeat for 31 s")
    assert services.sweep_lost_nodes(now=t(40)) == []  # lost once, not again
    assert services.sweep_lost_nodes(now=t(56)) == ["chatty"]
    audit = AuditLog.objects.filter(action="node.lost", target_id="quiet").get()
    assert audit.actor_label == "system" and audit.data["to"] == "lost"


def test_a_heartbeat_does_not_revive_a_lost_node_registering_does(settings):
    settings.CRUCIBLE = {**settings.CRUCIBLE, "NODE_LOST_AFTER_S": 30}
    node, _ = services.register_node(actor=AGENT, registration=reg(), now=t(0))
    services.sweep_lost_nodes(now=t(60))
    assert services.heartbeat(name=node.name, now=t(61)).state == NodeState.LOST
    back, created = services.register_node(actor=AGENT, registration=reg(), now=t(62))
    assert not created and back.state == NodeState.READY and back.state_reason == ""
    assert states(node)[-2:] == [("ready", "lost"), ("lost", "ready")]


@pytest.mark.parametrize("held", ["cordon", "drain"])
def test_a_lost_node_returns_cordoned_or_draining_if_an_admin_left_it_so(settings, held):
    settings.CRUCIBLE = {**settings.CRUCIBLE, "NODE_LOST_AFTER_S": 30}
    node, _ = services.register_node(actor=AGENT, registration=reg(), now=t(0))
    getattr(services, held)(actor=ADMIN, node=node, reason="bad DIMM")
    services.sweep_lost_nodes(now=t(300))
    node.refresh_from_db()
    assert node.state == NodeState.LOST
    back, _ = services.register_node(actor=AGENT, registration=reg())
    expected = NodeState.CORDONED if held == "cordon" else NodeState.DRAINING
    assert back.state == expected


def test_admin_actions_follow_the_state_machine_and_are_audited():
    node, _ = services.register_node(actor=AGENT, registration=reg())
    assert services.drain(actor=ADMIN, node=node, reason="kernel upgrade").state == "draining"
    assert services.cordon(actor=ADMIN, node="gpu-a1", reason="NCCL errors").state == "cordoned"
    with pytest.raises(IllegalTransition, match="is cordoned; cordon applies"):
        services.cordon(actor=ADMIN, node=node, reason="again")
    done = services.uncordon(actor=ADMIN, node=node)
    assert (done.state, done.state_reason) == ("ready", "")
    with pytest.raises(IllegalTransition):
        services.uncordon(actor=ADMIN, node=node)
    assert states(node) == [("ready", "ready"), ("ready", "draining"),
                            ("draining", "cordoned"), ("cordoned", "ready")]
    rows = AuditLog.objects.filter(target_type="node", action__in=[
        "node.drain", "node.cordon", "node.uncordon"]).order_by("id")
    assert [(r.action, r.actor_label, r.data["reason"]) for r in rows] == [
        ("node.drain", "ops-alice", "kernel upgrade"), ("node.cordon", "ops-alice", "NCCL errors"),
        ("node.uncordon", "ops-alice", "")]


def test_cordon_and_drain_need_a_reason_and_a_known_node():
    node, _ = services.register_node(actor=AGENT, registration=reg())
    with pytest.raises(InvalidInput, match="reason"):
        services.cordon(actor=ADMIN, node=node, reason="   ")
    with pytest.raises(InvalidInput, match="at most 500"):
        services.drain(actor=ADMIN, node=node, reason="x" * 501)
    with pytest.raises(NotFound):
        services.cordon(actor=ADMIN, node="nope", reason="x")
    node.refresh_from_db()
    assert node.state == NodeState.READY
    assert not AuditLog.objects.filter(action="node.cordon").exists()


def test_n_consecutive_infra_failures_cordon_the_node_naming_them(settings):
    settings.CRUCIBLE = {**settings.CRUCIBLE, "NODE_INFRA_FAILURES_TO_CORDON": 3}
    node, _ = services.register_node(actor=AGENT, registration=reg())
    services.record_run_failure(node=node, infra=True, detail="CUDA error: ECC")
    services.record_run_failure(node=node, infra=True, detail="CUDA error: ECC")
    node.refresh_from_db()
    assert (node.state, node.consecutive_infra_failures) == ("ready", 2)
    hit = services.record_run_failure(node=node, infra=True, detail="NCCL timeout on rank 3")
    assert hit.state == NodeState.CORDONED
    assert hit.state_reason == ("3 consecutive infrastructure failures; last: NCCL timeout "
                                "on rank 3")
    audit = AuditLog.objects.get(action="node.auto_cordon")
    assert audit.actor_label == "system" and audit.data["from"] == "ready"
    # Already cordoned: more failures are counted, not transitioned again.
    services.record_run_failure(node=node, infra=True)
    assert NodeTransition.objects.filter(node=node, to_state="cordoned").count() == 1
    # Uncordoning is a fresh start for the count.
    assert services.uncordon(actor=ADMIN, node=node).consecutive_infra_failures == 0


@pytest.mark.parametrize("reset", ["success", "own_failure"])
def test_a_success_or_a_runs_own_failure_resets_the_count(settings, reset):
    settings.CRUCIBLE = {**settings.CRUCIBLE, "NODE_INFRA_FAILURES_TO_CORDON": 3}
    node, _ = services.register_node(actor=AGENT, registration=reg())
    for _ in range(2):
        services.record_run_failure(node=node, infra=True)
    if reset == "success":
        services.record_run_success(node=node)
    else:
        services.record_run_failure(node=node, infra=False)
    for _ in range(2):
        services.record_run_failure(node=node, infra=True)
    node.refresh_from_db()
    assert (node.state, node.consecutive_infra_failures) == ("ready", 2)


def test_a_first_registration_that_loses_the_insert_race_updates_the_winner():
    """Two agents first registering one name at once: the loser's insert clashes on the
    unique name inside a savepoint, and its transaction goes on to update the winner's row
    (what register_node does next) instead of failing with a 500."""
    from django.db import transaction

    from apps.scheduling.services import _insert

    winner, _ = services.register_node(actor=AGENT, registration=reg(), now=t(0))
    with transaction.atomic():
        assert _insert(actor=AGENT, name="gpu-a1", capacity={"pool": "gpu"}, now=t(1)) is None
        assert Node.objects.select_for_update().get(name="gpu-a1").pk == winner.pk
    assert Node.objects.count() == 1 and NodeTransition.objects.count() == 1


def test_the_sweep_command_marks_silent_nodes_lost(settings):
    from io import StringIO

    from django.core.management import call_command

    settings.CRUCIBLE = {**settings.CRUCIBLE, "NODE_LOST_AFTER_S": 30}
    services.register_node(actor=AGENT, registration=reg("old"),
                           now=timezone.now() - timedelta(minutes=2))
    services.register_node(actor=AGENT, registration=reg("fresh"))
    out = StringIO()
    call_command("sweep_leases", stdout=out)
    assert out.getvalue() == "node old lost\n"
    assert dict(Node.objects.values_list("name", "state")) == {"old": "lost", "fresh": "ready"}


def test_durations_read_at_a_glance():
    from apps.scheduling.selectors import duration

    assert [duration(s) for s in (0, 31, 119, 120, 7_199, 7_200, 172_799, 172_800, -5)] == [
        "0 s", "31 s", "119 s", "2 min", "119 min", "2 h", "47 h", "2 d", "0 s"]
