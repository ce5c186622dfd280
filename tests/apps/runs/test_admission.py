"""The admission loop with ``CRUCIBLE_SCHEDULER`` on: a launch is not dispatched; a pass
writes allocations onto specific nodes and GPUs and dispatches on commit; what does not fit
waits with a reason and a position; quotas bind across teams of a cohort; a worker claims only
allocated runs; every exit path releases the allocation; one leader at a time."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from apps.core.actor import Actor
from apps.core.exceptions import Conflict, InvalidInput
from apps.core.models import AuditLog
from apps.projects.models import Project
from apps.runs import admission, services
from apps.runs.dispatch import EXECUTE_TASK
from apps.runs.models import Run, RunStatus
from apps.scheduling import services as scheduling_services
from apps.scheduling.models import Allocation, Node
from apps.teams.models import Team
from config.celery import app
from tests.django_fixtures import Caller
from tests.factories import ProjectFactory, make_run
from tests.skips import host_skip

Capture = Callable[..., AbstractContextManager[list[Callable[[], None]]]]
SYSTEM = Actor.system()


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    def record(name: str, args: list[Any] | None = None, **options: Any) -> None:
        calls.append({"name": name, "args": args, **options})

    monkeypatch.setattr(app, "send_task", record)
    return calls


@pytest.fixture
def on(settings: Any) -> None:
    settings.CRUCIBLE = {**settings.CRUCIBLE, "SCHEDULER": True}


def gpu_node(name: str, gpus: int = 4, gpu_type: str = "H100") -> Node:
    return Node.objects.create(name=name, pool="gpu", gpu_type=gpu_type, gpu_count=gpus,
                               cpus=64, memory_mb=512_000)


def gpu_run(project: Project, gpus: int = 1, **overrides: Any) -> Run:
    return make_run(project, pool="gpu",
                    resources={"gpus_per_node": gpus, "cpus": 1, "memory_gb": 1}, **overrides)


def held(run: Run) -> dict[str, list[int]]:
    return {a.node.name: a.gpu_ids for a in Allocation.objects.filter(
        run=run, released_at__isnull=True).select_related("node")}


def claim(run: Run, node: str | None = None) -> Run:
    """Claim as a worker on the run's (first) allocated node, unless ``node`` says another."""
    node = node or min(held(run), default=None)
    claimed = services.claim(actor=SYSTEM, pool=run.pool, worker_id="w", team_id=None,
                             run_id=run.pk, node=node)
    assert claimed is not None
    return claimed


pytestmark = pytest.mark.usefixtures("on")


def test_a_launch_is_not_dispatched_and_a_pass_without_nodes_says_why(
        project: Project, sent: list[dict[str, Any]],
        django_capture_on_commit_callbacks: Capture) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        run = gpu_run(project)  # the commit runs a pass: nothing to place it on
    assert sent == []
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED
    assert run.resources["gpus_per_node"] == 1 and run.priority_class == "default"
    assert run.wait_reason == "no fitting nodes" and run.queue_position == 1


def test_a_pass_admits_onto_specific_gpus_and_dispatches_on_commit(
        project: Project, sent: list[dict[str, Any]],
        django_capture_on_commit_callbacks: Capture) -> None:
    gpu_node("n1", gpus=4)
    a, b = gpu_run(project, gpus=2), gpu_run(project, gpus=1)
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        result = admission.admission_pass()
    assert result["leader"] is True
    assert sent == []  # nothing leaves before the commit
    for callback in callbacks:
        callback()
    assert {tuple(m["args"]) for m in sent} == {(str(a.pk),), (str(b.pk),)}
    # To the node's queue, not the pool's: only n1's workers may take them.
    assert all(m["name"] == EXECUTE_TASK and m["queue"] == "node.n1"
               and m["kwargs"] == {"pool": "gpu"} for m in sent)
    assert held(a) == {"n1": [0, 1]} and held(b) == {"n1": [2]}
    # A second pass admits nothing twice and sends nothing again.
    sent.clear()
    with django_capture_on_commit_callbacks(execute=True):
        admission.admission_pass()
    assert sent == [] and Allocation.objects.count() == 2


def test_runs_over_capacity_wait_with_reason_and_position(project: Project,
                                                          sent: list[dict[str, Any]]) -> None:
    gpu_node("n1", gpus=4)
    runs = [gpu_run(project, gpus=2) for _ in range(4)]
    admission.admission_pass()
    for run in runs:
        run.refresh_from_db()
    assert [bool(held(r)) for r in runs] == [True, True, False, False]
    waiting = runs[2:]
    assert [r.queue_position for r in waiting] == [1, 2]
    assert all(r.wait_reason for r in waiting)
    assert runs[0].wait_reason == "" and runs[0].queue_position is None


def test_the_default_queue_is_the_whole_cluster(project: Project, member: Caller) -> None:
    gpu_node("n1", gpus=4)
    Node.objects.create(name="c1", pool="cpu", cpus=16, memory_mb=64_000)
    body = member.client.get(f"/api/v1/teams/{project.team.slug}/queue").json()
    assert body["configured"] is False
    assert body["nominal"] == {"H100": 4.0, "cpu": 16.0} and body["cohort"] is None


def test_quotas_bind_across_two_teams_of_a_cohort(team: Team, other_team: Team,
                                                   sent: list[dict[str, Any]]) -> None:
    gpu_node("n1", gpus=8)
    for t, lend in ((team, 2.0), (other_team, 0.0)):
        scheduling_services.set_queue(actor=SYSTEM, team_id=t.pk, cohort="lab",
                                      nominal={"H100": 4.0}, lending_limit={"H100": lend},
                                      borrowing_limit={"H100": 2.0})
    mine, theirs = ProjectFactory(team=team), ProjectFactory(team=other_team)
    # other_team asks for 8 GPUs' worth in 1-GPU runs: 4 nominal + 2 borrowed (all team lends).
    their_runs = [gpu_run(theirs) for _ in range(8)]
    admission.admission_pass()
    assert sum(bool(held(r)) for r in their_runs) == 6
    # team reclaims within its nominal: 2 are free, and 2 of its own nominal were lent.
    my_runs = [gpu_run(mine) for _ in range(4)]
    admission.admission_pass()
    assert sum(bool(held(r)) for r in my_runs) == 2
    assert Allocation.objects.filter(released_at__isnull=True).count() == 8
    stuck = [r for r in their_runs if not held(r)]
    for r in stuck:
        r.refresh_from_db()
    assert {r.wait_reason for r in stuck} == {"quota"}


def test_a_claim_without_an_allocation_is_refused(project: Project, worker: Any) -> None:
    run = gpu_run(project)
    r = worker.post("/api/v1/worker/claim", {"pool": "gpu", "worker_id": "w1",
                                             "run_id": str(run.pk)}, format="json")
    assert r.status_code == 409, r.content
    assert "has no allocation" in r.json()["message"]
    # The pool-wide claim only picks allocated runs.
    r = worker.post("/api/v1/worker/claim", {"pool": "gpu", "worker_id": "w1", "node": "n1"},
                    format="json")
    assert r.status_code == 204
    gpu_node("n1", gpus=1)
    admission.admission_pass()
    r = worker.post("/api/v1/worker/claim", {"pool": "gpu", "worker_id": "w1", "node": "n1"},
                    format="json")
    assert r.status_code == 200 and r.json()["id"] == str(run.pk)


def test_a_claim_from_a_node_the_allocation_does_not_name_is_refused(
        project: Project, worker: Any, sent: list[dict[str, Any]]) -> None:
    gpu_node("n1", gpus=1)
    gpu_node("n2", gpus=1)
    run = gpu_run(project)
    admission.admission_pass()
    [(placed, _)] = held(run).items()
    other = ({"n1", "n2"} - {placed}).pop()
    body = {"pool": "gpu", "worker_id": "w1", "run_id": str(run.pk)}
    r = worker.post("/api/v1/worker/claim", {**body, "node": other}, format="json")
    assert r.status_code == 409, r.content
    assert r.json()["code"] == "wrong_node"
    assert f"allocated to node {placed}, not to this worker's node '{other}'" in \
        r.json()["message"]
    # A worker that does not say its node is refused too while the scheduler is on, and the
    # pool-wide claim from the other node finds nothing of its own.
    r = worker.post("/api/v1/worker/claim", body, format="json")
    assert r.status_code == 409 and r.json()["code"] == "node_required"
    r = worker.post("/api/v1/worker/claim", {"pool": "gpu", "worker_id": "w1", "node": other},
                    format="json")
    assert r.status_code == 204
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED
    r = worker.post("/api/v1/worker/claim", {**body, "node": placed}, format="json")
    assert r.status_code == 200 and r.json()["id"] == str(run.pk)


@pytest.mark.parametrize("exit_path", ["succeeded", "failed", "retry", "cancel_running",
                                       "cancel_queued", "lease_expired"])
def test_every_exit_path_releases_the_allocation(project: Project, exit_path: str,
                                                 sent: list[dict[str, Any]]) -> None:
    gpu_node("n1", gpus=1)
    run = gpu_run(project)
    admission.admission_pass()
    assert held(run)
    if exit_path == "cancel_queued":
        services.cancel(actor=SYSTEM, run=run)
    else:
        run = claim(run)
        lease = run.lease_id
        services.worker_transition(actor=SYSTEM, run=run, lease_id=lease, to="running")
        if exit_path in ("succeeded", "failed"):
            services.worker_transition(actor=SYSTEM, run=run, lease_id=lease, to=exit_path,
                                       error="boom")
        elif exit_path == "retry":
            services.worker_transition(actor=SYSTEM, run=run, lease_id=lease, to="failed",
                                       error="CUDA error", retry=True)
        elif exit_path == "cancel_running":
            services.cancel(actor=SYSTEM, run=run)
        else:
            Run.objects.filter(pk=run.pk).update(
                lease_expires_at=timezone.now() - timedelta(seconds=1))
            services.sweep_expired(actor=SYSTEM)
    assert held(run) == {}
    assert Allocation.objects.filter(run=run, released_at__isnull=False).count() == 1


def test_infra_failures_count_on_the_allocated_node_and_success_resets(
        project: Project, settings: Any, sent: list[dict[str, Any]]) -> None:
    node = gpu_node("n1", gpus=1)
    run = gpu_run(project)
    admission.admission_pass()
    run = claim(run)
    services.worker_transition(actor=SYSTEM, run=run, lease_id=run.lease_id, to="failed",
                               error="Xid 79", retry=True)
    node.refresh_from_db()
    assert node.consecutive_infra_failures == 1
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED and held(run) == {}
    admission.admission_pass()
    run = claim(run)
    services.worker_transition(actor=SYSTEM, run=run, lease_id=run.lease_id, to="succeeded")
    node.refresh_from_db()
    assert node.consecutive_infra_failures == 0


def test_a_production_run_preempts_a_preemptible_one_then_starts_when_it_stops(
        project: Project, sent: list[dict[str, Any]], worker: Any,
        django_capture_on_commit_callbacks: Capture) -> None:
    gpu_node("n1", gpus=2)
    victim = gpu_run(project, gpus=2, priority_class="preemptible")
    admission.admission_pass()
    victim = claim(victim)
    services.worker_transition(actor=SYSTEM, run=victim, lease_id=victim.lease_id,
                               to="running")
    urgent = gpu_run(project, gpus=2, priority_class="production")
    # Past its minimum runtime (10 min), within what it may lose without a checkpoint (15).
    later = timezone.now() + timedelta(minutes=12)
    Run.objects.filter(pk=victim.pk).update(lease_expires_at=later + timedelta(hours=1))
    with django_capture_on_commit_callbacks(execute=True):
        result = admission.admission_pass(now=later)
    assert result["preempted"] == [str(victim.pk)] and result["admitted"] == [str(urgent.pk)]
    victim.refresh_from_db()
    assert victim.preempt_deadline_at is not None and victim.status == RunStatus.RUNNING
    r = worker.post(f"/api/v1/worker/runs/{victim.pk}/heartbeat",
                    HTTP_X_CRUCIBLE_LEASE=victim.lease_id)
    assert r.json()["stop"] == "preempt"
    # The urgent run holds the GPUs but is not sent, nor claimable, while the victim runs.
    assert held(urgent) == {"n1": [0, 1]}
    assert [m for m in sent if m["args"] == [str(urgent.pk)]] == []
    with pytest.raises(Conflict, match="waits for preempted runs"):
        claim(urgent)
    # Past the deadline the victim's lease is revoked; it is queued again, not failed.
    with django_capture_on_commit_callbacks(execute=True):
        admission.admission_pass(now=victim.preempt_deadline_at + timedelta(seconds=1))
    victim.refresh_from_db()
    assert victim.status == RunStatus.QUEUED and victim.preemptions == 1
    assert services.attempts_left(victim) == victim.max_attempts
    assert held(victim) == {}
    # The attempt reads as preempted (the scheduler's doing), not as a lost worker.
    assert [(a.outcome, a.error) for a in victim.attempts.order_by("number")] == [
        ("preempted", "preempted by the scheduler (lease revoked at the deadline)")]
    assert [m["args"] for m in sent][-1] == [str(urgent.pk)]
    assert claim(urgent).status == RunStatus.CLAIMED


def test_launch_validates_resources_and_priority_class(project: Project) -> None:
    with pytest.raises(InvalidInput, match="resources.gpus_per_node"):
        make_run(project, pool="gpu", resources={"gpus_per_node": 0})
    with pytest.raises(InvalidInput, match="resources.nodes"):
        make_run(project, pool="gpu", resources={"gpus_per_node": 1, "nodes": 0})
    with pytest.raises(InvalidInput, match="unknown field"):
        make_run(project, resources={"gpu": 1})
    with pytest.raises(InvalidInput, match="priority_class 'urgent'"):
        make_run(project, priority_class="urgent")
    cpu = make_run(project)
    assert cpu.resources["gpus_per_node"] == 0 and cpu.resources["cpus"] == 1.0


def test_the_team_default_priority_comes_from_its_queue(project: Project) -> None:
    scheduling_services.set_queue(actor=SYSTEM, team_id=project.team_id, cohort=None,
                                  nominal={"H100": 8}, default_priority="preemptible")
    assert gpu_run(project).priority_class == "preemptible"


def test_staff_set_a_queue_members_read_it(project: Project, member: Caller,
                                           make_caller: Callable[..., Caller]) -> None:
    url = f"/api/v1/teams/{project.team.slug}/queue"
    doc = {"cohort": "lab", "nominal": {"H100": 8}, "lending_limit": {"H100": 4},
           "default_priority": "default"}
    assert member.client.put(url, doc, format="json").status_code == 403
    staff = make_caller(project.team, "member", "staffer")
    staff.user.is_staff = True
    staff.user.save()
    r = staff.client.put(url, doc, format="json")
    assert r.status_code == 200, r.content
    body = member.client.get(url).json()
    assert body["configured"] and body["cohort"] == "lab" and body["lending_limit"] == {
        "H100": 4.0}
    assert AuditLog.objects.filter(action="queue.set", team_id=project.team_id).count() == 1
    bad = staff.client.put(url, {**doc, "lending_limit": {"H100": 9}}, format="json")
    assert bad.status_code == 400 and "lending_limit" in bad.json()["message"]
    # OPTIONS describes nothing here (the fuzzer found DRF's metadata looking up a `pk`: a 500)
    assert staff.client.options(url).status_code == 405


def test_the_cluster_queue_lists_pending_runs_with_reasons(project: Project,
                                                           member: Caller,
                                                           outsider: Caller) -> None:
    run = gpu_run(project)
    admission.admission_pass()
    body = member.client.get("/api/v1/cluster/queue").json()
    assert body["scheduler"] is True
    (queue,) = body["queues"]
    assert queue["pending"] == 1
    assert queue["runs"][0]["id"] == str(run.pk)
    assert queue["runs"][0]["wait_reason"] == "no fitting nodes"
    (theirs,) = outsider.client.get("/api/v1/cluster/queue").json()["queues"]
    assert theirs["pending"] == 1 and theirs["runs"] == []  # counted, not shown
    detail = member.client.get(f"/api/v1/teams/{project.team.slug}/runs/{run.pk}").json()
    assert detail["wait_reason"] == "no fitting nodes" and detail["queue_position"] == 1


def test_a_second_pass_while_one_leads_does_nothing(project: Project) -> None:
    gpu_node("n1", gpus=1)
    gpu_run(project)
    if connection.vendor == "postgresql":
        host_skip("the PostgreSQL lock is tested with two connections below")
    with admission._file_lock() as leader:
        assert leader
        assert admission.admission_pass() == {"leader": False}
    assert Allocation.objects.count() == 0
    assert admission.admission_pass()["leader"] is True


@pytest.mark.django_db(transaction=True)
def test_the_advisory_lock_admits_one_leader_across_connections(team: Team) -> None:
    if connection.vendor != "postgresql":
        host_skip("PostgreSQL only: SQLite uses the file lock (tested above)")
    import psycopg
    from django.db import connections

    params = connections["default"].get_connection_params()
    with psycopg.connect(**params, autocommit=False) as other:
        other.execute("SELECT pg_advisory_xact_lock(%s)", [admission.LOCK_KEY])
        assert admission.admission_pass() == {"leader": False}
        other.rollback()
    assert admission.admission_pass()["leader"] is True


def test_with_the_scheduler_off_the_pass_does_nothing(project: Project, settings: Any,
                                                      sent: list[dict[str, Any]],
                                                      django_capture_on_commit_callbacks:
                                                      Capture) -> None:
    settings.CRUCIBLE = {**settings.CRUCIBLE, "SCHEDULER": False}
    with django_capture_on_commit_callbacks(execute=True):
        run = gpu_run(project)
    assert [m["args"] for m in sent] == [[str(run.pk)]]
    assert admission.admission_pass() == {"enabled": False}
    assert claim(run).status == RunStatus.CLAIMED


def test_the_pages_show_who_holds_which_gpus_and_why_a_run_waits(project: Project,
                                                                  member: Caller) -> None:
    from django.test import Client

    gpu_node("n1", gpus=2)
    running, waiting = gpu_run(project, gpus=2), gpu_run(project, gpus=1)
    admission.admission_pass()
    client = Client()
    client.force_login(member.user)
    html = client.get("/cluster/").content.decode()
    assert html.count(f'data-run="{running.pk}"') == 2
    assert "GPU 0: run " + str(running.pk)[:8] in html
    assert f'data-queue="{project.team.slug}"' in html
    assert '<td class="nowrap in-use">H100 2</td>' in html  # what the team holds now
    page = client.get(f"/t/{project.team.slug}/runs/{waiting.pk}/").content.decode()
    waiting.refresh_from_db()
    assert 'id="run-wait"' in page and waiting.wait_reason in page
    assert "position 1 in its queue" in page


def test_a_worker_that_stops_when_asked_requeues_its_run_at_once(
        project: Project, pool: Any, sent: list[dict[str, Any]]) -> None:
    """The cooperative path through the SDK: the heartbeat's ``stop: preempt`` makes
    ``should_stop`` true; reporting ``preempted`` requeues the run before its deadline."""
    gpu_node("n1", gpus=1)
    victim = gpu_run(project, priority_class="preemptible")
    admission.admission_pass()
    session = pool.claim("gpu", "w1", run_id=str(victim.pk), node="n1")
    session.set_status("running")
    with pytest.raises(Exception, match="was not asked to stop"):
        session.set_status("preempted")
    session.heartbeat()
    assert not session.should_stop
    services.request_preemption(actor=SYSTEM, run=victim,
                                deadline=timezone.now() + timedelta(minutes=5), reason="test")
    session.heartbeat()
    assert session.should_stop and session.preempt_requested
    session.set_status("preempted")
    victim.refresh_from_db()
    assert victim.status == RunStatus.QUEUED and victim.preemptions == 1
    assert victim.preempt_deadline_at is None and held(victim) == {}
    assert services.attempts_left(victim) == victim.max_attempts
    assert [a.outcome for a in victim.attempts.all()] == ["preempted"]


def test_a_gang_is_allocated_whole_across_nodes_and_sent_once(
        project: Project, sent: list[dict[str, Any]],
        django_capture_on_commit_callbacks: Capture) -> None:
    gpu_node("n1", gpus=2)
    gpu_node("n2", gpus=2)
    gang = make_run(project, pool="gpu", resources={"gpus_per_node": 2, "nodes": 2})
    too_big = make_run(project, pool="gpu", resources={"gpus_per_node": 2, "nodes": 3})
    with django_capture_on_commit_callbacks(execute=True):
        admission.admission_pass()
    assert held(gang) == {"n1": [0, 1], "n2": [0, 1]}
    assert [(m["args"], m["queue"]) for m in sent] == [([str(gang.pk)], "node.n1")]
    # Any node of the gang may claim it (its ranks meet there); the first node got the message.
    assert claim(gang, node="n2").status == RunStatus.CLAIMED
    too_big.refresh_from_db()
    assert held(too_big) == {} and too_big.wait_reason


def test_a_run_that_ends_hands_its_gpus_to_the_next_on_commit(
        project: Project, sent: list[dict[str, Any]],
        django_capture_on_commit_callbacks: Capture) -> None:
    gpu_node("n1", gpus=1)
    first, second = gpu_run(project), gpu_run(project)
    admission.admission_pass()
    first = claim(first)
    assert held(second) == {}
    with django_capture_on_commit_callbacks(execute=True):
        services.worker_transition(actor=SYSTEM, run=first, lease_id=first.lease_id,
                                   to="succeeded")
    assert held(second) == {"n1": [0]}
    assert [m["args"] for m in sent][-1] == [str(second.pk)]
