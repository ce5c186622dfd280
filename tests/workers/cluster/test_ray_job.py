"""Multi-node train runs on a real local Ray cluster (``ray.cluster_utils.Cluster``: a head and
three worker nodes on this host, CPU only, one core each), against the single-host torchrun run:

- a 2-rank ZeRO-2 run placed one rank per node (STRICT_SPREAD, pinned to named nodes) reports
  the same per-step losses as the 2-rank torchrun run;
- a gang the cluster cannot place fails within its timeout, naming what is missing;
- killing the node of rank 1 mid-run fails that attempt naming rank 1 (never a hang), and the
  next attempt resumes from the last checkpoint on the remaining nodes: attempts
  [lost, succeeded], contiguous steps, the uninterrupted run's losses;
- a rank that raises fails the attempt naming it (final), and a preemption asked by the
  driver's reporter reaches the ranks, which checkpoint their last completed step and stop.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.ray_fixtures import NAMES, ray_cluster_fixture  # noqa: F401 - ray_cluster
from tests.workers.rl.test_rl_distributed import CONFIG, finish, launch, losses
from workers.cluster.plan import ClusterPlan
from workers.cluster.ray_job import (
    PlacementFailed,
    RankFailed,
    run_on_ray,
    run_with_retries,
)
from workers.reporting import Stopped
from workers.rl.sinks import JsonlSink, read_jsonl
from workers.rl.spec import load_spec

TOLERANCE = 1e-6  # absolute, as the torchrun test: CPU fp32 with fixed seeds replays exactly
ZERO2 = CONFIG.replace("zero_stage = 3", "zero_stage = 2")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def lose_node(cluster: Any, rank: dict[str, Any]) -> None:
    """The node of ``rank`` goes, as a machine does: every process on it at once. Removing a
    node (SIGKILL to its raylet and stores) leaves its worker processes running until they
    notice, and a rank was seen training two more steps with its peer in that time; so the
    rank's process is killed first."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(rank["pid"], signal.SIGKILL)
    node = next(n for n in cluster.worker_nodes if n.node_id == rank["node_id"])
    cluster.remove_node(node, allow_graceful=False)


class Recorder(JsonlSink):
    """The driver's reporter: the run's JSON lines, plus the placement events kept in memory
    so a test can find the node a rank runs on."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.placements: list[list[dict[str, Any]]] = []
        self.on_checkpoint: Callable[[int], None] | None = None  # called before the ack

    def event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        if data and "placement" in data:
            self.placements.append(data["placement"])
        super().event(level, message, data)

    def checkpoint(self, step: int, uri: str, metrics: dict[str, float]) -> None:
        super().checkpoint(step, uri, metrics)
        if self.on_checkpoint is not None:
            self.on_checkpoint(step)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The single-host 2-rank torchrun run's per-step losses (ZeRO-2)."""
    run_dir = tmp_path_factory.mktemp("torchrun")
    finish(launch(run_dir, config=ZERO2), run_dir)
    ref = losses(run_dir)
    assert sorted(ref) == [1, 2, 3, 4, 5, 6]
    return ref


def spec_in(run_dir: Path) -> Any:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.toml").write_text(ZERO2.format(dir=run_dir))
    return load_spec(run_dir / "run.toml")


def test_an_unplaceable_gang_fails_within_its_timeout(ray_cluster, tmp_path):
    spec = spec_in(tmp_path / "run")
    plan = ClusterPlan(nodes=4, placement_timeout_s=5)  # three nodes offer CPUs
    with pytest.raises(PlacementFailed, match="could not place 4 node bundles"):
        run_on_ray(spec, Recorder(tmp_path / "run" / "metrics.jsonl"), plan)
    named = ClusterPlan(nodes=2, node_names=("n0", "gone"), placement_timeout_s=5)
    with pytest.raises(PlacementFailed, match="crucible-node-<name>"):
        run_on_ray(spec, Recorder(tmp_path / "run" / "metrics.jsonl"), named)


def test_two_nodes_match_the_single_host_run(ray_cluster, reference, tmp_path):
    run_dir = tmp_path / "ray"
    spec = spec_in(run_dir)
    rec = Recorder(run_dir / "metrics.jsonl")
    plan = ClusterPlan(nodes=2, node_names=("n0", "n2"), collective_timeout_s=120)
    result = run_on_ray(spec, rec, plan)

    assert result.start == 0 and result.trained == [1, 2, 3, 4, 5, 6] and result.steps == 6
    (placement,) = rec.placements
    assert [p["rank"] for p in placement] == [0, 1]
    assert placement[0]["node_id"] != placement[1]["node_id"], "one rank per node"
    assert [NAMES[p["node_id"]] for p in placement] == ["n0", "n2"], "the allocation's nodes"

    got = losses(run_dir)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert abs(got[step] - reference[step]) <= TOLERANCE, (step, got[step], reference[step])
    records = read_jsonl(run_dir / "metrics.jsonl")
    first = next(r for r in records if r["kind"] == "event" and "rank(s)" in r["message"]
                 and "spec" in r["data"])
    assert first["data"]["world_size"] == 2
    outputs = [r for r in records if r["kind"] == "event" and r["message"].startswith("rank ")
               and "stream" in r["data"]]
    assert {r["data"]["rank"] for r in outputs} == {0, 1}, "both ranks' output is streamed"
    assert [r["step"] for r in records if r["kind"] == "checkpoint"][:3] == [2, 4, 6]
    assert (run_dir / "ckpt" / "final" / "model.safetensors").is_file()


def test_a_lost_node_fails_the_attempt_naming_the_rank_and_the_run_resumes(
        ray_cluster, reference, tmp_path):
    run_dir = tmp_path / "killed"
    spec = spec_in(run_dir)
    rec = Recorder(run_dir / "metrics.jsonl")
    killed: dict[str, Any] = {}

    def kill_rank1_node(step: int) -> None:
        """Remove (SIGKILL, raylet included) the node of rank 1 while step 2's checkpoint is
        being reported: rank 0 waits for the driver's acknowledgement, so the run is at step
        2 when the node goes."""
        if step != 2 or killed:
            return
        rank1 = rec.placements[0][1]
        killed["node_id"], killed["steps_before"] = rank1["node_id"], max(losses(run_dir))
        lose_node(ray_cluster, rank1)

    rec.on_checkpoint = kill_rank1_node
    outcomes, result = run_with_retries(
        spec, rec, lambda attempt: ClusterPlan(nodes=2, collective_timeout_s=60,
                                               failure_grace_s=60, placement_timeout_s=120),
        max_attempts=2)
    assert killed.get("node_id"), "the node was never killed"

    assert outcomes == ["lost", "succeeded"]
    lost = [r for r in read_jsonl(run_dir / "metrics.jsonl")
            if r["kind"] == "event" and r["message"].startswith("attempt 1 lost")]
    assert len(lost) == 1 and lost[0]["data"]["rank"] == 1, lost
    assert "rank 1 (node" in lost[0]["message"] and "died" in lost[0]["message"]
    assert killed["steps_before"] == 2

    # The second attempt ran on the two nodes left, from the last checkpoint, to the end.
    second = rec.placements[1]
    assert killed["node_id"] not in {p["node_id"] for p in second}
    assert result.start == 2
    assert result.trained == list(range(result.start + 1, 7))
    resumed = [r for r in read_jsonl(run_dir / "metrics.jsonl")
               if r["kind"] == "event" and r["message"].startswith("resumed from")]
    assert [r["data"]["step"] for r in resumed] == [result.start]
    got = losses(run_dir)  # the last loss reported per step: contiguous 1..6
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert abs(got[step] - reference[step]) <= TOLERANCE, (step, got[step], reference[step])
    with open(run_dir / "metrics.jsonl") as f:
        assert all(json.loads(line) for line in f)


def test_a_rank_that_raises_fails_the_attempt_naming_it(ray_cluster, tmp_path):
    """A deterministic error inside the ranks (a layout the engine refuses) is a final
    RankFailed naming rank 0, not a hang and not a retry."""
    run_dir = tmp_path / "bad"
    run_dir.mkdir()
    (run_dir / "run.toml").write_text(
        ZERO2.format(dir=run_dir).replace("prompts_per_step = 4", "prompts_per_step = 3"))
    spec = load_spec(run_dir / "run.toml")
    with pytest.raises(RankFailed, match=r"rank 0 \(node .*\) failed: ValueError") as info:
        run_on_ray(spec, Recorder(run_dir / "metrics.jsonl"), ClusterPlan(nodes=2))
    assert info.value.retryable is False


class PreemptAfter(Recorder):
    """A driver-side reporter that asks for a preemption once step ``at``'s loss is reported,
    as the worker's does when the heartbeat says ``stop: preempt``."""

    def __init__(self, path: Path, at: int) -> None:
        super().__init__(path)
        self.at, self.asked = at, False

    def log(self, step: int, metrics: dict[str, float]) -> None:
        super().log(step, metrics)
        if step == self.at and "loss" in metrics:
            self.asked = True

    def should_stop(self) -> bool:
        return self.asked

    def preempted(self) -> bool:
        return self.asked


def test_a_preemption_reaches_the_ranks_which_checkpoint_and_stop(ray_cluster, tmp_path):
    """The driver's stop crosses the relay to rank 0, the ranks agree on it, checkpoint the
    last completed step (recorded through the driver) and stop: Stopped, not a failure."""
    run_dir = tmp_path / "preempted"
    spec = spec_in(run_dir)
    rec = PreemptAfter(run_dir / "metrics.jsonl", at=3)
    with pytest.raises(Stopped, match="preempted after step"):
        run_on_ray(spec, rec, ClusterPlan(nodes=2, collective_timeout_s=120))
    records = read_jsonl(run_dir / "metrics.jsonl")
    stopped_at = max(r["step"] for r in records if r["kind"] == "metrics"
                     and "loss" in r["metrics"])
    # The stop lands at the first safe point after the driver has seen step 3's report.
    assert 3 <= stopped_at < 6, stopped_at
    assert stopped_at in [r["step"] for r in records if r["kind"] == "checkpoint"]
    assert (run_dir / "ckpt" / f"step-{stopped_at:06d}" / "state.json").is_file()
    assert not (run_dir / "ckpt" / "final").exists()


class CancelAfter(Recorder):
    """A driver-side reporter whose run is canceled once step ``at`` is reported (``how =
    "cancel"``: it answers should_stop), or whose lease is lost then (``how = "lease"``: it
    raises Stopped from the report, as the worker's ApiReporter does)."""

    def __init__(self, path: Path, at: int, how: str) -> None:
        super().__init__(path)
        self.at, self.how, self.asked = at, how, False

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.asked and self.how == "lease":
            raise Stopped("lease lost")
        super().log(step, metrics)
        if step == self.at and "loss" in metrics:
            self.asked = True

    def should_stop(self) -> bool:
        return self.asked and self.how == "cancel"


@pytest.mark.parametrize("how", ["cancel", "lease"])
def test_a_cancel_or_a_lost_lease_stops_the_ranks_without_a_checkpoint(ray_cluster, tmp_path,
                                                                       how):
    run_dir = tmp_path / how
    spec = spec_in(run_dir)
    rec = CancelAfter(run_dir / "metrics.jsonl", at=3, how=how)
    with pytest.raises(Stopped):
        run_on_ray(spec, rec, ClusterPlan(nodes=2, collective_timeout_s=120))
    records = read_jsonl(run_dir / "metrics.jsonl")
    logged = [r["step"] for r in records if r["kind"] == "metrics" and "loss" in r["metrics"]]
    if how == "lease":  # the reporter refuses everything after step 3
        assert logged == [1, 2, 3]
    else:  # the stop lands at the first safe point after the driver saw step 3's report
        assert logged == list(range(1, len(logged) + 1)) and 3 <= len(logged) < 6, logged
    # Only periodic checkpoints (every 2 steps): a cancel or a lost lease writes none of its own.
    written = sorted(int(p.name.split("-")[1]) for p in (run_dir / "ckpt").glob("step-*"))
    assert written and set(written) <= {2, 4}, written
    assert not (run_dir / "ckpt" / "final").exists()
