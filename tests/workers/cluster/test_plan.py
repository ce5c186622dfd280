"""The pure parts of multi-node runs: which claimed runs go to Ray and what they ask for, the
check that an attempt trained what it had left, and the failure a lost rank raises."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from workers.cluster.plan import ClusterPlan, node_resource, plan_for
from workers.cluster.progress import IncompleteRun, check_trained

REPO = Path(__file__).resolve().parents[3]


def test_single_host_runs_keep_the_in_process_path():
    assert plan_for({}) is None
    assert plan_for({"nodes": 1, "gpus_per_node": 8}) is None
    assert plan_for({"nodes": 1}, ["a"]) is None


def test_rollout_actors_take_a_run_to_ray_even_on_one_node():
    plan = plan_for({"nodes": 1}, ["a"], rollout_actors=1)
    assert plan is not None and (plan.nodes, plan.world) == (1, 1)


def test_rollout_actors_are_one_per_rank_and_need_ray():
    """Bad rollout-actor settings fail before anything is placed, naming the fix."""
    _rollout_actors = pytest.importorskip("workers.cluster.ray_job")._rollout_actors
    from workers.rl.spec import parse_spec
    from workers.rl.trainer import Trainer

    two = parse_spec({"cluster": {"rollout_actors": 2}})
    assert _rollout_actors(two, ClusterPlan(nodes=2)) == 2
    assert _rollout_actors(parse_spec({}), ClusterPlan(nodes=2)) == 0
    with pytest.raises(ValueError, match=r"rollout_actors = 2: .* give the number of ranks \(3\)"):
        _rollout_actors(two, ClusterPlan(nodes=3))
    vllm = parse_spec({"rollout": {"backend": "vllm"}, "cluster": {"rollout_actors": 2}})
    with pytest.raises(ValueError, match="cluster.rollout_gpus = 1"):
        _rollout_actors(vllm, ClusterPlan(nodes=2))
    with pytest.raises(ValueError, match="started on one host without Ray"):
        Trainer(two, None, None, rank=0, world=1)
    # vLLM with a staleness bound: only rollout actors push versions into vLLM engines.
    with pytest.raises(ValueError, match="max_async_steps"):
        parse_spec({"rollout": {"backend": "vllm"}, "trainer": {"max_async_steps": 1}})
    parse_spec({"rollout": {"backend": "vllm"}, "trainer": {"max_async_steps": 1},
                "cluster": {"rollout_actors": 1, "rollout_gpus": 1}})


def test_a_gang_gets_one_bundle_per_node_pinned_to_its_allocation():
    plan = plan_for({"nodes": 2, "gpus_per_node": 4}, ["gpu-a", "gpu-b"])
    assert plan is not None and (plan.nodes, plan.ranks_per_node, plan.world) == (2, 4, 8)
    assert plan.bundles() == [
        {"CPU": 4.0, "GPU": 4.0, "crucible-node-gpu-a": 0.001},
        {"CPU": 4.0, "GPU": 4.0, "crucible-node-gpu-b": 0.001},
    ]
    cpu = plan_for({"nodes": 3, "gpus_per_node": 0})  # scheduler off: counts only
    assert cpu is not None and cpu.bundles() == [{"CPU": 1.0}] * 3 and cpu.world == 3


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="2 node names for 3 nodes"):
        ClusterPlan(nodes=3, node_names=("a", "b"))
    with pytest.raises(ValueError, match="ranks_per_node must equal"):
        ClusterPlan(nodes=2, ranks_per_node=1, gpus_per_node=2)
    with pytest.raises(ValueError, match="letters, digits"):
        node_resource("a b")


def test_check_trained_refuses_a_resume_that_trained_nothing():
    assert check_trained(2, 6, [5, 3, 4, 6]) == [3, 4, 5, 6]
    assert check_trained(6, 6, []) == []  # resumed at the end: nothing was left
    with pytest.raises(IncompleteRun, match="trained nothing"):
        check_trained(2, 6, [])
    with pytest.raises(IncompleteRun, match=r"missing \[6\]"):
        check_trained(2, 6, [3, 4, 5])
    assert IncompleteRun.retryable is False


def test_rank_failures_say_whether_to_retry_and_survive_pickling():
    ray_job = pytest.importorskip("workers.cluster.ray_job")
    died = ray_job.RankFailed(1, "node x", "gone", died=True)
    bug = ray_job.RankFailed(0, "node y", "bad", died=False, cause=ValueError("bad layout"))
    infra = ray_job.RankFailed(0, "node y", "io", died=False, cause=OSError("disk"))
    assert (died.retryable, bug.retryable, infra.retryable) == (True, False, True)
    back = pickle.loads(pickle.dumps(died))
    assert (str(back), back.rank, back.died, back.retryable) == (str(died), 1, True, True)
    assert pickle.loads(pickle.dumps(bug)).retryable is False
    rollouts = pytest.importorskip("workers.cluster.rollouts")
    lost = pickle.loads(pickle.dumps(rollouts.RolloutFailed(0, "node z", "gone", died=True)))
    assert (str(lost), lost.index, lost.retryable) == ("rollout actor 0 (node z) died: gone",
                                                      0, True)


def test_the_worker_adapters_load_without_ray():
    """A single-host worker never pays for Ray: the train adapter imports only the pure plan
    (import-linter's contract forbids any other module from importing Ray at all)."""
    code = ("import sys, workers.adapters, workers.cluster.plan, workers.cluster.progress; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
