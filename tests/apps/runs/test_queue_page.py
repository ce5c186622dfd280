"""``/cluster/queue/`` rendered by Django, after a real admission pass: each queue's runs in
order with the reason each waits and what it asks for, an admitted run with the node it starts
on, another team's runs counted but not listed, staff seeing every run, the cohort's pooled
quota and who borrows; and the pure helpers by hand."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from apps.core.actor import Actor
from apps.runs import admission
from apps.runs.models import Run
from apps.runs.queue_pages import cohorts, describe_resources
from apps.scheduling import services as scheduling_services
from apps.scheduling.selectors import QueueUse
from config.celery import app
from tests.apps.runs.test_admission import gpu_node, gpu_run
from tests.factories import ProjectFactory

SYSTEM = Actor.system()


def test_describe_resources_by_hand() -> None:
    assert describe_resources({"gpus_per_node": 2, "nodes": 4, "gpu_types": ["H100", "A100"]},
                              "gpu") == "2 GPUs × 4 nodes (H100 or A100)"
    assert describe_resources({"gpus_per_node": 1}, "gpu") == "1 GPU (any type)"
    assert describe_resources(None, "gpu") == "1 GPU (any type)"  # the launch default
    assert describe_resources({"gpus_per_node": 0, "cpus": 4}, "cpu") == "4 CPUs"
    assert describe_resources(None, "sandbox") == "1 CPU"


def test_cohorts_pool_quota_and_name_the_borrowers() -> None:
    uses = [QueueUse("a", "lab", True, {"H100": 4.0}, {"H100": 6.0}),
            QueueUse("b", "lab", True, {"H100": 4.0, "cpu": 8.0}, {"cpu": 2.0}),
            QueueUse("c", "", False, {"H100": 8.0}, {"H100": 8.0})]
    (lab,) = cohorts(uses)
    assert lab.name == "lab" and lab.teams == ["a", "b"]
    assert lab.nominal == {"H100": 8.0, "cpu": 8.0}
    assert lab.in_use == {"H100": 6.0, "cpu": 2.0}
    assert lab.borrowed == {"a": {"H100": 2.0}}


@pytest.fixture
def queued(db: None, team: Any, other_team: Any, settings: Any,
           monkeypatch: pytest.MonkeyPatch) -> dict[str, Run]:
    """Two teams of cohort "lab" on one 2-GPU node, one GPU of nominal quota each, no
    borrowing: each team's first 1-GPU run is admitted; the rest wait for quota."""
    settings.CRUCIBLE = {**settings.CRUCIBLE, "SCHEDULER": True}
    monkeypatch.setattr(app, "send_task", lambda *a, **k: None)  # no broker in this test
    gpu_node("gpu-1", gpus=2)
    for t in (team, other_team):
        scheduling_services.set_queue(actor=SYSTEM, team_id=t.pk, cohort="lab",
                                      nominal={"H100": 1.0}, borrowing_limit={"H100": 0.0})
    mine, theirs = ProjectFactory(team=team), ProjectFactory(team=other_team)
    runs = {"first": gpu_run(mine, name="first"), "big": gpu_run(mine, gpus=2, name="big"),
            "third": gpu_run(mine, name="third"), "rival": gpu_run(theirs, name="rival"),
            "rival2": gpu_run(theirs, name="rival2")}
    admission.admission_pass()
    return {k: Run.objects.get(pk=r.pk) for k, r in runs.items()}


def signed_in(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_members_see_their_queue_in_order_with_reasons(queued: dict[str, Run],
                                                      member: Any) -> None:
    html = signed_in(member.user).get("/cluster/queue/").content.decode()
    assert "The scheduler is off" not in html
    assert 'data-queue="acme"' in html and 'data-queue="rival"' in html
    assert "2 waiting, 1 admitted and starting" in html
    assert "admitted: starting on <code>gpu-1</code>" in html
    big, third = queued["big"], queued["third"]
    assert big.wait_reason and third.wait_reason  # the pass said why
    for run in (big, third):
        row = html.split(f'data-run="{run.pk}"')[1].split("</tr>")[0]
        assert f">{run.queue_position}<" in row
        assert run.wait_reason in row
    assert "2 GPUs (any type)" in html
    # the rival team's runs are counted, not listed
    assert f'data-run="{queued["rival2"].pk}"' not in html
    assert "Not your team&#x27;s runs." in html or "Not your team's runs." in html
    # the cohort pools both queues' nominal quota; nobody borrows
    cohort = html.split('data-cohort="lab"')[1].split("</tr>")[0]
    assert "H100 2" in cohort and "nothing" in cohort


def test_staff_see_every_run_and_the_page_is_linked_and_signed_in_only(
        queued: dict[str, Run], member: Any) -> None:
    member.user.is_staff = True
    member.user.save(update_fields=["is_staff"])
    client = signed_in(member.user)
    html = client.get("/cluster/queue/").content.decode()
    assert f'data-run="{queued["rival2"].pk}"' in html
    assert 'href="/cluster/queue/"' in client.get("/cluster/").content.decode()
    partial = client.get("/cluster/queue/", HTTP_HX_REQUEST="true").content.decode()
    assert partial.startswith('<div id="cluster-queue">')
    anonymous = Client().get("/cluster/queue/")
    assert anonymous.status_code == 302 and "/accounts/login/" in anonymous["Location"]
    assert client.post("/cluster/queue/").status_code == 405


def test_with_the_scheduler_off_the_page_says_so(db: None, member: Any) -> None:
    html = signed_in(member.user).get("/cluster/queue/").content.decode()
    assert "The scheduler is off" in html
    assert "Nothing is waiting" in html
