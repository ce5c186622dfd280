"""``/cluster/`` rendered by Django: the nodes with their GPUs and states for anyone signed
in, the action forms for staff only, a refused POST for others, and an htmx action that
answers with the table showing the outcome (or the error, the node unchanged)."""

from __future__ import annotations

import pytest
from django.test import Client

from apps.scheduling.models import Node
from tests.apps.scheduling.test_api import make_node

pytestmark = pytest.mark.django_db


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_the_page_lists_nodes_without_actions_for_non_staff(member):
    make_node("gpu-a1")
    make_node("cpu-1", pool="cpu", gpu_type="", gpu_count=0, memory_mb=2048)
    html = signed_in(member.user).get("/cluster/").content.decode()
    assert 'data-node="gpu-a1"' in html and 'data-node="cpu-1"' in html
    assert "2 nodes, 8 GPUs" in html and "2 GiB" in html
    assert 'name="action"' not in html
    assert 'href="/cluster/"' in html  # linked from the nav


def test_non_staff_post_is_refused(member):
    make_node()
    response = signed_in(member.user).post("/cluster/", {"node": "gpu-a1", "action": "cordon",
                                                         "reason": "x"})
    assert response.status_code == 403
    assert Node.objects.get().state == "ready"


def test_anonymous_is_sent_to_log_in(db):
    response = Client().get("/cluster/")
    assert response.status_code == 302 and "/accounts/login/" in response["Location"]


@pytest.fixture
def staff(make_caller):
    caller = make_caller(username="ops")
    caller.user.is_staff = True
    caller.user.save(update_fields=["is_staff"])
    return signed_in(caller.user)


def test_staff_cordon_through_htmx_shows_state_and_reason(staff):
    make_node()
    assert 'value="cordon"' in staff.get("/cluster/").content.decode()
    response = staff.post("/cluster/", {"node": "gpu-a1", "action": "cordon",
                                        "reason": "fans failing"}, HTTP_HX_REQUEST="true")
    html = response.content.decode()
    assert response.status_code == 200 and html.startswith('<div id="cluster-nodes">')
    assert "gpu-a1 is cordoned." in html and "fans failing" in html
    assert 'value="uncordon"' in html
    assert Node.objects.get().state == "cordoned"


def test_an_action_without_reason_shows_the_error_and_changes_nothing(staff):
    make_node()
    html = staff.post("/cluster/", {"node": "gpu-a1", "action": "drain", "reason": ""},
                      HTTP_HX_REQUEST="true").content.decode()
    assert 'id="cluster-error"' in html and "say why the node is draining" in html
    assert Node.objects.get().state == "ready"


def test_a_plain_form_post_redirects_back_with_a_message(staff):
    make_node()
    response = staff.post("/cluster/", {"node": "gpu-a1", "action": "cordon",
                                        "reason": "bad PSU"}, follow=True)
    assert response.redirect_chain[-1][0] == "/cluster/"
    assert "gpu-a1 is cordoned." in response.content.decode()
