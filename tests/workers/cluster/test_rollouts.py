"""Rollout actors on a real local Ray cluster (``ray.cluster_utils.Cluster``: a head with no CPUs
and three one-core worker nodes, CPU only), each on its own placement bundle, fed weights by
its learner rank over a gloo group of two:

- one rollout actor, driven from this process as a rank drives it: it samples each step only
  with the weights of the version it must (it waits, and stalls loudly, rather than sample
  older ones), takes versions only upwards, holds the pushed weights bitwise, and a push to an
  actor that stopped answering (SIGSTOP: a hung process) fails within its timeout naming it;
- a run with 1 learner rank + 1 rollout actor on another node trains, every push is proven
  bitwise (the rank's checksum, the actor's on arrival and after loading its policy copy), and
  with synchronous settings its per-step losses equal the single-host in-process run's;
- losing the rollout actor's node mid-run fails the attempt naming the actor, and the next
  attempt resumes from the last checkpoint: attempts [lost, succeeded], contiguous steps.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from tests.ray_fixtures import REPO, ray_cluster_fixture  # noqa: F401 - ray_cluster
from tests.workers.cluster.test_ray_job import ZERO2, Recorder
from tests.workers.rl.test_rl_distributed import losses
from workers.cluster.plan import ClusterPlan
from workers.cluster.ray_job import run_on_ray, run_with_retries
from workers.cluster.rollouts import RemoteRollouts, RolloutActor, RolloutFailed
from workers.cluster.weights import WeightPushTimeout
from workers.rl.actor import AsyncStall, Producer, RolloutSetup
from workers.rl.curriculum import TaskSampler
from workers.rl.model import build_policy
from workers.rl.sinks import read_jsonl
from workers.rl.spec import load_spec

# Absolute, on per-step losses. The actor's policy copy holds the rank's weights bitwise (the
# checksums prove it), samples with the same seeded generators on one thread each, so the
# batches, and hence the losses, replay exactly: any difference is a bug, not rounding.
TOLERANCE = 1e-6
STEPS = [1, 2, 3, 4, 5, 6]
ACTORS = """
[cluster]
rollout_actors = 1
verify_pushes = true
push_timeout_s = 60
"""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def spec_in(run_dir: Path, actors: bool = True) -> Any:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.toml").write_text(ZERO2.format(dir=run_dir) + (ACTORS if actors else ""))
    return load_spec(run_dir / "run.toml")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The single-host, single-process run's per-step losses: one rank sampling inline with
    its own module (trainer.max_async_steps = 0), no Ray."""
    run_dir = tmp_path_factory.mktemp("inprocess")
    spec_in(run_dir, actors=False)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CRUCIBLE_THREADS": "1",
           "CRUCIBLE_DEVICE": "cpu"}
    env.pop("RANK", None)
    with open(run_dir / "log.txt", "w") as log:
        subprocess.run([sys.executable, "-m", "workers.rl", "train", "--config",
                        str(run_dir / "run.toml")], cwd=REPO, env=env, check=True,
                       timeout=600, stdout=log, stderr=subprocess.STDOUT)
    ref = losses(run_dir)
    assert sorted(ref) == STEPS
    return ref


def rank_setup(spec: Any, tmp_path: Path) -> tuple[RolloutSetup, dict[str, torch.Tensor]]:
    """What rank 0 of a one-rank run hands its rollout actor, built from the same pieces."""
    from workers.rl.trainer import Trainer

    quiet = spec.output.model_copy(update={"metrics_jsonl": str(tmp_path / "m.jsonl"),
                                           "stdout": False})
    trainer = Trainer(spec.model_copy(update={"cluster": None, "output": quiet}), None, None,
                      rank=0, world=1)
    tok = trainer.tokenizer()
    sampler = TaskSampler(trainer.objective.train, spec.curriculum, spec.trainer.seed, 0, 1,
                          trainer.seeds.permutation)
    producer = Producer(spec, trainer.objective, sampler, tok.pad_token_id,
                        spec.trainer.prompts_per_step, 0, trainer.seeds.generator, 0)
    model = build_policy(spec.model, len(tok), tok.pad_token_id, tok.eos_token_id)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    setup = RolloutSetup(producer=producer, model_spec=spec.model, tokenizer=tok, start=0,
                         total=spec.trainer.steps, bound=0, timeout=3.0, bf16=False,
                         aux_free=False)
    return setup, weights


def nudged(weights: dict[str, torch.Tensor], by: float) -> dict[str, torch.Tensor]:
    return {k: v + by if v.is_floating_point() else v for k, v in weights.items()}


def test_an_actor_samples_only_allowed_versions_and_a_hung_push_fails_naming_it(
        ray_cluster, tmp_path):
    spec = spec_in(tmp_path / "run")
    setup, weights = rank_setup(spec, tmp_path)
    actor = RolloutActor.options(num_cpus=1, max_concurrency=8).remote(  # type: ignore[attr-defined]
        0, {"CRUCIBLE_DEVICE": "cpu", "CRUCIBLE_THREADS": "1"})
    place = ray.get(actor.where.remote(), timeout=120)
    launcher = RemoteRollouts(actor, 0, place, push_timeout_s=3.0, bucket_bytes=64 * 1024,
                              verify=True)
    try:
        source = launcher.start(setup, weights)  # pushes version 0
        first = source.get(0)
        assert first.step == 0 and first.versions == [0] * spec.trainer.prompts_per_step
        assert first.batch.completion_ids.shape[0] == 4 * spec.rollout.group_size

        source.publish(1, nudged(weights, 0.01))
        with pytest.raises(RolloutFailed, match="refuses the older or equal 1"):
            source.publish(1, nudged(weights, 0.02))
        second = source.get(1)
        assert second.versions == [1] * spec.trainer.prompts_per_step
        # Every push arrived bitwise, and the copy sampled with hashes as what arrived.
        pushes = launcher.pushes()
        assert [p["version"] for p in pushes] == [0, 1]
        assert all(p["learner"] == p["actor"] for p in pushes)
        loaded = ray.get(actor.loads.remote(), timeout=60)
        assert loaded == {p["version"]: p["learner"] for p in pushes}

        # Step 2 needs version 2 (no off-policy lag allowed): the actor waits for it and
        # fails loudly instead of sampling with version 1.
        with pytest.raises(AsyncStall, match="weights of version >= 2"):
            source.get(2)

        # A hung actor (stopped, not dead) never takes the next push: it fails in bounded
        # time, naming the actor.
        os.kill(place["pid"], signal.SIGSTOP)
        try:
            with pytest.raises(WeightPushTimeout,
                               match=rf"rollout actor 0 \(node .* pid {place['pid']}\) did not "
                                     "take weight version 2"):
                source.publish(2, nudged(weights, 0.03))
        finally:
            os.kill(place["pid"], signal.SIGCONT)
    finally:
        ray.kill(actor, no_restart=True)


def test_a_rank_and_its_rollout_actor_match_the_in_process_run(ray_cluster, reference,
                                                               tmp_path):
    run_dir = tmp_path / "actors"
    spec = spec_in(run_dir)
    rec = Recorder(run_dir / "metrics.jsonl")
    result = run_on_ray(spec, rec, ClusterPlan(nodes=1, collective_timeout_s=120))

    assert result.trained == STEPS
    (rank0,), (actor0,) = result.placement, result.rollouts
    assert actor0["node_id"] != rank0["node_id"], "the actor runs on a node of its own"
    # Every push (the start's version 0, then one per update) arrived bitwise, and every
    # version the actor sampled with was its policy copy exactly (version 6 trains nothing).
    pushes = result.pushes[0]
    assert [p["version"] for p in pushes] == [0, *STEPS]
    for p in pushes:
        assert p["learner"] == p["actor"], p
        assert p["loaded"] == (p["learner"] if p["version"] < 6 else None), p
    assert len({p["learner"] for p in pushes}) == 7, "each update changed the weights"

    got = losses(run_dir)
    assert sorted(got) == STEPS
    for step in STEPS:
        assert abs(got[step] - reference[step]) <= TOLERANCE, (step, got[step], reference[step])
    records = read_jsonl(run_dir / "metrics.jsonl")
    lags = [r["metrics"]["async/lag0"] for r in records
            if r["kind"] == "metrics" and "async/lag0" in r["metrics"]]
    assert lags == [4.0 * spec.rollout.group_size] * 6, "every sample had lag 0"


def test_an_off_policy_actor_stays_within_its_bound(ray_cluster, tmp_path):
    """trainer.max_async_steps = 1: the actor samples ahead with weights at most one version
    behind (the learner's lag histogram fails the run on any other), and the run trains every
    step. Which lag each sample gets depends on timing; that it is 0 or 1 does not."""
    run_dir = tmp_path / "async"
    run_dir.mkdir()
    (run_dir / "run.toml").write_text(
        ZERO2.format(dir=run_dir).replace("seed = 7", "seed = 7\nmax_async_steps = 1")
        + ACTORS)
    spec = load_spec(run_dir / "run.toml")
    assert spec.trainer.max_async_steps == 1
    result = run_on_ray(spec, Recorder(run_dir / "metrics.jsonl"), ClusterPlan(nodes=1))
    assert result.trained == STEPS
    per_step = 4.0 * spec.rollout.group_size
    for r in read_jsonl(run_dir / "metrics.jsonl"):
        if r["kind"] == "metrics" and "async/lag0" in r["metrics"]:
            m = r["metrics"]
            assert m["async/lag0"] + m["async/lag1"] == per_step, m
            assert "async/lag2" not in m
    assert all(p["learner"] == p["actor"] for p in result.pushes[0])


def test_losing_the_rollout_actors_node_fails_the_attempt_naming_it_and_the_run_resumes(
        ray_cluster, reference, tmp_path):
    run_dir = tmp_path / "killed"
    spec = spec_in(run_dir)
    rec = Recorder(run_dir / "metrics.jsonl")
    killed: dict[str, Any] = {}
    rollouts: list[list[dict[str, Any]]] = []
    event = rec.event

    def keep_rollouts(level: str, message: str, data: dict[str, Any] | None = None) -> None:
        if data and "rollouts" in data:
            rollouts.append(data["rollouts"])
        event(level, message, data)

    rec.event = keep_rollouts  # type: ignore[method-assign]

    def kill_actor_node(step: int) -> None:
        """While step 2's checkpoint is reported (rank 0 waits for it), the actor's node goes:
        its process first, then the node (raylet and stores), as a machine fails."""
        if step != 2 or killed:
            return
        actor = rollouts[0][0]
        killed["node_id"], killed["steps_before"] = actor["node_id"], max(losses(run_dir))
        with contextlib.suppress(ProcessLookupError):
            os.kill(actor["pid"], signal.SIGKILL)
        node = next(n for n in ray_cluster.worker_nodes if n.node_id == actor["node_id"])
        ray_cluster.remove_node(node, allow_graceful=False)

    rec.on_checkpoint = kill_actor_node
    outcomes, result = run_with_retries(
        spec, rec, lambda attempt: ClusterPlan(nodes=1, collective_timeout_s=60,
                                               failure_grace_s=60, placement_timeout_s=120),
        max_attempts=2)
    assert killed.get("node_id"), "the node was never killed"
    assert killed["steps_before"] == 2

    assert outcomes == ["lost", "succeeded"]
    lost = [r for r in read_jsonl(run_dir / "metrics.jsonl")
            if r["kind"] == "event" and r["message"].startswith("attempt 1 lost")]
    assert len(lost) == 1 and lost[0]["data"]["rollout_actor"] == 0, lost
    assert "rollout actor 0 (node" in lost[0]["message"] and "died" in lost[0]["message"]

    assert killed["node_id"] not in {p["node_id"] for p in rollouts[1]}
    assert result.start == 2 and result.trained == [3, 4, 5, 6]
    assert [p["version"] for p in result.pushes[0]] == [2, 3, 4, 5, 6]
    got = losses(run_dir)  # the last loss reported per step: contiguous 1..6
    assert sorted(got) == STEPS
    for step in STEPS:
        assert abs(got[step] - reference[step]) <= TOLERANCE, (step, got[step], reference[step])
