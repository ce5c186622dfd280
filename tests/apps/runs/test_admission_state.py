"""The loop's two pure halves without a database: rows -> ClusterState (which runs the engine
sees, as what) and actions -> the rows a pass writes."""

from __future__ import annotations

from datetime import UTC, datetime

from apps.runs.admission_apply import plan
from apps.runs.admission_loader import NodeRow, RunRow, build_state
from workers.scheduling.actions import Admit, Preempt, Wait
from workers.scheduling.spec import QueueSpec
from workers.scheduling.state import WorkloadStatus

T0 = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
ONE_GPU = {"gpus_per_node": 1, "nodes": 1, "cpus": 1.0, "memory_gb": 1.0}


def row(run_id: str, status: str, allocation: dict | None = None, **kw: object) -> RunRow:
    return RunRow(id=run_id, queue="acme", priority_class="default", resources=ONE_GPU,
                  status=status, submitted_at=T0, allocation=allocation or {}, **kw)


def test_runs_map_to_workloads_by_status_and_allocation() -> None:
    state = build_state(
        nodes=[NodeRow("n1", "H100", 4, 64, 500.0, "gpu", "ready"),
               NodeRow("c1", "cpu", 0, 16, 64.0, "cpu", "cordoned")],
        queues=[QueueSpec(name="acme", nominal={"H100": 4})],
        runs=[row("pending", "queued"), row("admitted", "queued", {"n1": (0,)}),
              row("running", "running", {"n1": (1,)}, started_at=T0),
              row("stopping", "claimed", {"n1": (2,)}, stopping=True),
              row("unscheduled", "running")],  # started before the scheduler was on
        now=T0)
    by_id = {w.id: w for w in state.workloads}
    assert {k: v.status for k, v in by_id.items()} == {
        "pending": WorkloadStatus.PENDING, "admitted": WorkloadStatus.ADMITTED,
        "running": WorkloadStatus.RUNNING, "stopping": WorkloadStatus.STOPPING}
    assert by_id["pending"].allocation == {}
    assert by_id["running"].started_at == T0.timestamp()
    assert [n.gpu_ids for n in state.nodes] == [(0, 1, 2, 3), ()]
    assert state.nodes[1].state == "cordoned"
    # Which GPUs hold: admitted and running, not the stopping one (already re-promised).
    assert state.gpus_in_use()["n1"] == {0, 1}


def test_actions_become_rows() -> None:
    result = plan([Admit("a", {"n1": (0, 1)}, "H100"), Preempt("v", "reclaim", "a"),
                   Wait("w", "quota", 2, estimated_start=T0.timestamp())])
    assert [a.workload_id for a in result.admits] == ["a"]
    assert [p.workload_id for p in result.preempts] == ["v"]
    assert result.waits["w"].position == 2 and result.waits["w"].reason == "quota"
    assert result.waits["w"].estimated_start_at == T0
    assert result.summary() == {"admitted": ["a"], "preempted": ["v"], "waiting": 1}


def test_a_run_avoids_the_nodes_whose_probe_fails_a_language_it_needs() -> None:
    state = build_state(
        nodes=[NodeRow("n1", "H100", 4, 64, 500.0, "gpu", "ready", broken=frozenset({"python"})),
               NodeRow("n2", "H100", 4, 64, 500.0, "gpu", "ready", broken=frozenset({"c"})),
               NodeRow("n3", "H100", 4, 64, 500.0, "gpu", "ready")],
        queues=[QueueSpec(name="acme", nominal={"H100": 12})],
        runs=[row("python", "queued", languages=frozenset({"python"})),
              row("both", "queued", languages=frozenset({"python", "c"})),
              row("none", "queued")],
        now=T0)
    by_id = {w.id: w for w in state.workloads}
    assert {k: v.avoid for k, v in by_id.items()} == {
        "python": {"n1"}, "both": {"n1", "n2"}, "none": frozenset()}
