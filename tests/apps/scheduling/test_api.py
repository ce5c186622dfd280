"""The inventory over HTTP, probed as a hostile tenant: node agents need an operator worker
token (user tokens and team worker tokens are refused) and send validated bodies; anyone
signed in reads /api/v1/cluster/nodes, only staff act, an unknown node is 404, a bad body is
a 400 that names the field, and every action leaves an audit row."""

from __future__ import annotations

from typing import Any

import pytest

from apps.core.actor import Actor
from apps.core.models import AuditLog
from apps.scheduling import services
from apps.scheduling.models import Node, NodeTransition
from apps.teams.services import worker_token_create
from tests.django_fixtures import client_for_token
from workers.protocol import NodeRegistration

REGISTER = "/api/v1/worker/nodes/register"
NODES = "/api/v1/cluster/nodes"
BODY: dict[str, Any] = {"name": "gpu-a1", "pool": "gpu", "gpu_type": "H100", "gpu_count": 8,
                        "cpus": 64, "memory_mb": 512_000, "labels": {"zone": "a"}}


def make_node(name: str = "gpu-a1", **overrides: Any) -> Node:
    doc = {**BODY, "name": name, **overrides}
    node, _ = services.register_node(actor=Actor.system(),
                                     registration=NodeRegistration.model_validate(doc))
    return node


# --- worker API ---------------------------------------------------------------------------


def test_agent_registers_again_and_again_and_heartbeats(worker):
    first = worker.post(REGISTER, BODY, format="json")
    assert first.status_code == 201, first.content
    assert first.json() == {"name": "gpu-a1", "state": "ready", "state_reason": "",
                            "recheck": []}
    again = worker.post(REGISTER, {**BODY, "gpu_count": 4}, format="json")
    assert again.status_code == 200
    assert Node.objects.get(name="gpu-a1").gpu_count == 4
    beat = worker.post("/api/v1/worker/nodes/gpu-a1/heartbeat", {}, format="json")
    assert beat.status_code == 200 and beat.json()["state"] == "ready"


def test_heartbeat_tells_a_cordoned_agent_so(worker):
    node = make_node()
    services.cordon(actor=Actor.system(), node=node, reason="bad GPU 3")
    beat = worker.post("/api/v1/worker/nodes/gpu-a1/heartbeat", None, format="json")
    assert beat.json() == {"name": "gpu-a1", "state": "cordoned", "state_reason": "bad GPU 3",
                           "recheck": []}


def test_heartbeat_of_an_unregistered_node_is_404_saying_register(worker):
    response = worker.post("/api/v1/worker/nodes/ghost/heartbeat", {}, format="json")
    assert response.status_code == 404
    assert "register it first" in response.json()["message"]


def test_user_tokens_are_refused_on_node_endpoints(owner):
    for url in (REGISTER, "/api/v1/worker/nodes/gpu-a1/heartbeat"):
        response = owner.client.post(url, BODY, format="json")
        assert response.status_code == 403, response.content
        assert "worker token" in response.json()["message"]
    assert not Node.objects.exists()


def test_a_teams_worker_token_may_not_register_or_speak_for_a_node(team):
    _, raw = worker_token_create(actor=Actor.system(), team=team, name="team-pool")
    client = client_for_token(raw)
    make_node()
    for url in (REGISTER, "/api/v1/worker/nodes/gpu-a1/heartbeat"):
        response = client.post(url, {**BODY, "gpu_count": 1024}, format="json")
        assert response.status_code == 403
        assert "operator worker tokens" in response.json()["message"]
    assert Node.objects.get().gpu_count == 8


@pytest.mark.parametrize(("patch", "field", "words"), [
    ({"pool": "tpu"}, "pool", "gpu"),
    ({"name": "../etc"}, "name", "pattern"),
    ({"name": ""}, "name", "at least 1"),
    ({"gpu_count": -1}, "gpu_count", "greater than or equal to 0"),
    ({"cpus": "lots"}, "cpus", "integer"),
    ({"gpu_type": ""}, "non_field_errors", "gpu_type is required"),
    ({"gpu_count": 0}, "non_field_errors", "leave it empty"),
    ({"labels": {"bad key!": "x"}}, "labels", "label key"),
    ({"labels": {f"k{i}": "v" for i in range(33)}}, "labels", "at most 32"),
])
def test_bad_registrations_are_400_naming_the_field(worker, patch, field, words):
    response = worker.post(REGISTER, {**BODY, **patch}, format="json")
    assert response.status_code == 400, response.content
    body = response.json()
    assert body["code"] == "invalid" and field in body["errors"], body
    assert words in body["message"] or words in str(body["errors"]), body
    assert not Node.objects.exists()


def test_a_registration_that_is_not_an_object_is_400(worker):
    response = worker.post(REGISTER, [1, 2], format="json")
    assert response.status_code == 400 and response.json()["code"] == "invalid"
    missing = worker.post(REGISTER, {"name": "x"}, format="json").json()
    assert {"pool", "cpus", "memory_mb"} <= set(missing["errors"])


def test_the_sweep_reports_lost_nodes(worker, settings):
    settings.CRUCIBLE = {**settings.CRUCIBLE, "NODE_LOST_AFTER_S": 0}
    make_node()
    response = worker.post("/api/v1/worker/sweep")
    assert response.status_code == 200
    assert response.json()["nodes_lost"] == ["gpu-a1"]
    assert Node.objects.get().state == "lost"


# --- admin API ----------------------------------------------------------------------------


@pytest.fixture
def staff(make_caller):
    caller = make_caller(username="ops")
    caller.user.is_staff = True
    caller.user.save(update_fields=["is_staff"])
    return caller


def test_anyone_signed_in_reads_the_inventory(viewer):
    make_node("gpu-b2", gpu_count=2)
    make_node("gpu-a1")
    listing = viewer.client.get(NODES)
    assert listing.status_code == 200
    body = listing.json()
    assert [n["name"] for n in body["results"]] == ["gpu-a1", "gpu-b2"] and "next" in body
    assert body["results"][1]["gpu_count"] == 2 and body["results"][0]["state"] == "ready"
    detail = viewer.client.get(f"{NODES}/gpu-a1").json()
    assert detail["labels"] == {"zone": "a"} and detail["history"][0]["reason"] == "registered"


def test_the_list_pages_with_a_cursor(viewer):
    for i in range(3):
        make_node(f"n{i}")
    first = viewer.client.get(NODES, {"page_size": 2}).json()
    assert [n["name"] for n in first["results"]] == ["n0", "n1"]
    second = viewer.client.get(first["next"]).json()
    assert [n["name"] for n in second["results"]] == ["n2"] and second["next"] is None


def test_unknown_node_is_404(viewer, staff):
    assert viewer.client.get(f"{NODES}/nope").status_code == 404
    response = staff.client.post(f"{NODES}/nope/cordon", {"reason": "x"}, format="json")
    assert response.status_code == 404 and "No node 'nope'" in response.json()["message"]


@pytest.mark.parametrize("verb", ["cordon", "drain", "uncordon"])
def test_non_staff_cannot_act_even_as_team_owners(owner, verb):
    node = make_node()
    if verb == "uncordon":
        services.cordon(actor=Actor.system(), node=node, reason="setup")
    before = NodeTransition.objects.count()
    response = owner.client.post(f"{NODES}/gpu-a1/{verb}", {"reason": "mine now"},
                                 format="json")
    assert response.status_code == 403
    assert response.json()["message"].startswith(f"Only staff may {verb} nodes")
    assert NodeTransition.objects.count() == before


def test_worker_tokens_cannot_use_the_admin_api(worker):
    make_node()
    assert worker.get(NODES).status_code == 403
    assert worker.post(f"{NODES}/gpu-a1/cordon", {"reason": "x"}, format="json"
                       ).status_code == 403


def test_anonymous_is_401(db):
    from rest_framework.test import APIClient

    assert APIClient().get(NODES).status_code == 401


def test_staff_cordon_drain_uncordon_are_audited(staff):
    make_node()
    cordoned = staff.client.post(f"{NODES}/gpu-a1/cordon", {"reason": "ECC errors on GPU 5"},
                                 format="json")
    assert cordoned.status_code == 200, cordoned.content
    assert (cordoned.json()["state"], cordoned.json()["state_reason"]) == (
        "cordoned", "ECC errors on GPU 5")
    assert cordoned.json()["history"][0]["actor"] == "ops"
    assert staff.client.post(f"{NODES}/gpu-a1/drain", {"reason": "RMA"}, format="json"
                             ).json()["state"] == "draining"
    assert staff.client.post(f"{NODES}/gpu-a1/uncordon", {}, format="json"
                             ).json()["state"] == "ready"
    rows = AuditLog.objects.filter(target_type="node", target_id="gpu-a1",
                                   actor=staff.user).order_by("id")
    assert [r.action for r in rows] == ["node.cordon", "node.drain", "node.uncordon"]
    assert rows[0].data == {"from": "ready", "to": "cordoned", "reason": "ECC errors on GPU 5"}


@pytest.mark.parametrize(("body", "status", "words"), [
    ({}, 400, "reason: This field is required."),
    ({"reason": "   "}, 400, "reason: This field may not be blank."),
    ({"reason": "x" * 501}, 400, "reason"),
    ({"reason": "ok", "force": True}, 400, "force: unknown field"),
    ([1], 400, ""),
])
def test_bad_action_bodies_are_400_with_the_field(staff, body, status, words):
    make_node()
    response = staff.client.post(f"{NODES}/gpu-a1/cordon", body, format="json")
    assert response.status_code == status, response.content
    assert words in response.json()["message"]
    assert Node.objects.get().state == "ready"


def test_an_illegal_transition_is_409_saying_what_applies(staff):
    make_node()
    response = staff.client.post(f"{NODES}/gpu-a1/uncordon", {}, format="json")
    assert response.status_code == 409
    assert response.json()["message"] == ("Node 'gpu-a1' is ready; uncordon applies to a "
                                          "node that is cordoned, draining.")
