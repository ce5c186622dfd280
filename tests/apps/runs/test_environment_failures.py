"""A run whose environment's sandbox failed its health probe on a node: queued again (not the
run's own failure), counted against the node by the lemon rule, the node asked to re-check,
and, with the scheduler on, runs that need the broken language kept off the node until its
agent reports it healthy again."""

from __future__ import annotations

from typing import Any

import pytest

from apps.core.actor import Actor
from apps.environments import services as environment_services
from apps.projects.models import Project
from apps.runs import admission, services
from apps.runs.models import Run, RunEnvironment, RunStatus
from apps.scheduling import services as scheduling_services
from apps.scheduling.models import Allocation, Node
from tests.apps.scheduling.test_cluster_page import signed_in
from tests.django_fixtures import Caller
from tests.factories import make_run

SYSTEM = Actor.system()
BROKEN = {"python": {"ok": False, "detail": "python: sandbox failure: /usr/bin/bwrap is "
                                            "missing"}}


def cpu_node(name: str) -> Node:
    return Node.objects.create(name=name, pool="cpu", cpus=8, memory_mb=16_384)


def with_code_environment(project: Project, run: Run) -> Run:
    env = environment_services.environment_create(actor=SYSTEM, team=project.team,
                                                  project=project, slug="code")
    version, _ = environment_services.version_register(
        actor=SYSTEM, environment=env, spec={"source": "builtin", "name": "code"})
    RunEnvironment.objects.create(run=run, environment_version=version, position=0)
    return run


def claim(run: Run, node: str | None = None) -> Run:
    claimed = services.claim(actor=SYSTEM, pool=run.pool, worker_id="w", team_id=None,
                             run_id=run.pk, node=node)
    assert claimed is not None
    return claimed


def fail_environment(run: Run, node: str) -> Run:
    return services.worker_transition(actor=SYSTEM, run=run, lease_id=run.lease_id,
                                      to="failed", error="the sandbox cannot run python",
                                      cause="environment", node=node, toolchains=BROKEN)


def test_an_environment_failure_requeues_counts_on_the_node_and_asks_for_a_recheck(
        project: Project, worker: Any, member: Caller, settings: Any) -> None:
    settings.CRUCIBLE = {**settings.CRUCIBLE, "NODE_INFRA_FAILURES_TO_CORDON": 3}
    cpu_node("n1")
    run = make_run(project, max_attempts=3)
    for attempt in (1, 2, 3):
        run = fail_environment(claim(run), "n1")
        node = Node.objects.get(name="n1")
        assert node.consecutive_infra_failures == attempt
        assert node.recheck == ["python"] and node.broken_languages() == {"python"}
    run.refresh_from_db()
    # Out of attempts: failed for good, saying why; three in a row cordoned the node.
    assert run.status == RunStatus.FAILED
    assert run.error == ("the sandbox cannot run python — gave up after 3 of 3 attempts: the "
                         "environment's sandbox failed its health probe each time")
    assert node.state == "cordoned" and "3 consecutive infrastructure failures" in \
        node.state_reason
    # The API and the cluster page show what failed and that a re-check is asked.
    shown = member.client.get("/api/v1/cluster/nodes/n1").json()
    assert shown["toolchains"]["python"]["ok"] is False and shown["recheck"] == ["python"]
    assert shown["toolchains"]["python"]["source"] == f"run {run.pk}"
    page = signed_in(member.user).get("/cluster/").content.decode()
    assert "sandbox python broken (re-check asked): python: sandbox failure: /usr/bin/bwrap " \
           "is missing" in page
    # The heartbeat's answer asks the agent to re-check; its report clears the request.
    beat = worker.post("/api/v1/worker/nodes/n1/heartbeat", {}, format="json")
    assert beat.json()["recheck"] == ["python"]
    beat = worker.post("/api/v1/worker/nodes/n1/heartbeat",
                       {"toolchains": {"python": {"ok": True}}}, format="json")
    assert beat.status_code == 200 and beat.json()["recheck"] == []
    node.refresh_from_db()
    assert node.toolchains["python"]["ok"] is True and node.broken_languages() == frozenset()
    assert node.toolchains["python"]["source"] == "agent"


def test_the_first_environment_failure_is_retried_not_the_runs_own(project: Project) -> None:
    cpu_node("n1")
    run = fail_environment(claim(make_run(project, max_attempts=2)), "n1")
    assert run.status == RunStatus.QUEUED and run.error == ""
    assert services.attempts_left(run) == 1
    # A worker on a node the inventory does not know: the run is still retried.
    run = fail_environment(claim(run), "elsewhere")
    assert run.status == RunStatus.FAILED


def test_a_heartbeat_refuses_a_toolchain_report_that_is_not_a_language(worker: Any) -> None:
    cpu_node("n1")
    beat = worker.post("/api/v1/worker/nodes/n1/heartbeat",
                       {"toolchains": {"Not A Language": {"ok": True}}}, format="json")
    assert beat.status_code == 400, beat.content


@pytest.mark.usefixtures("_scheduler_on")
def test_the_scheduler_keeps_runs_off_a_node_whose_probe_fails_their_language(
        project: Project) -> None:
    cpu_node("n1")
    cpu_node("n2")
    Node.objects.filter(name="n1").update(toolchains=BROKEN)
    first = with_code_environment(project, make_run(project))
    admission.admission_pass()
    # Both nodes are empty: by name the run would go to n1, where python is broken.
    assert held_on(first) == "n2"
    Node.objects.filter(name="n2").update(state="cordoned")
    second = make_run(project)
    RunEnvironment.objects.create(run=second, environment_version=RunEnvironment.objects.get(
        run=first).environment_version, position=0)
    plain = make_run(project)
    admission.admission_pass()
    second.refresh_from_db()
    assert held_on(second) is None and second.wait_reason == "no fitting nodes"
    assert held_on(plain) == "n1"  # a run that needs no sandbox may use n1
    # n1's agent reports python healthy again: the waiting run goes there.
    scheduling_services.heartbeat(name="n1", toolchains={"python": {"ok": True}})
    admission.admission_pass()
    assert held_on(second) == "n1"


def held_on(run: Run) -> str | None:
    allocation = Allocation.objects.filter(run=run, released_at__isnull=True).first()
    return None if allocation is None else allocation.node.name


@pytest.fixture
def _scheduler_on(settings: Any) -> None:
    settings.CRUCIBLE = {**settings.CRUCIBLE, "SCHEDULER": True}
