"""A training run survives its worker: launched through the API, its worker is killed with
SIGKILL mid-run, the beat's sweep requeues it once the lease runs out, and a new worker
process resumes it from the last checkpoint in the object store; ``checkpoint.keep`` applies
in the object store, except to the checkpoint an evaluation started from meanwhile. Then a
second run starts from that run's checkpoint and is canceled mid-run, keeping its checkpoints.

Runs on both configurations: filesystem broker + SQLite, and Redis + PostgreSQL.
"""

from __future__ import annotations

import signal
import tarfile
from collections import Counter
from pathlib import Path

import pytest
from django.conf import settings as django_settings

from apps.core.actor import Actor
from apps.environments import services as env_services
from apps.metrics.models import MetricPoint
from apps.teams.models import Role
from apps.teams.services import personal_token_create, worker_token_create
from tests.e2e.conftest import wait_for
from tests.factories import MembershipFactory, ProjectFactory, TeamFactory, UserFactory
from workers.client import ApiError, CrucibleClient
from workers.storage import open_store

# Two worker processes each import torch and DeepSpeed: about a minute and a half on two
# quiet cores, several times that on a loaded machine, hence the longer timeout.
pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(900)]

STEPS = 8
TINY = {
    "model": {"preset": {"num_layers": 1}},
    "rollout": {"group_size": 2, "max_new_tokens": 2},
    "trainer": {"steps": STEPS, "prompts_per_step": 2, "micro_batch_size": 4, "zero_stage": 0,
                "eval_samples": 1},
    "checkpoint": {"every": 2, "keep": 1},
}
SFT_RECORDS = [{"prompt": f"{a} + {b} =", "completion": str(a + b)}
               for a in range(3) for b in range(3)]


def _setup():
    user = UserFactory(username="ft")
    team = TeamFactory(slug="ft")
    MembershipFactory(team=team, user=user, role=Role.MEMBER)
    project = ProjectFactory(team=team, slug="demo")
    _, token = personal_token_create(actor=Actor.of_user(user), user=user, name="ft")
    _, worker_token = worker_token_create(actor=Actor.system(), team=None, name="pool")
    system = Actor.system()
    env = env_services.environment_create(actor=system, team=team, project=project,
                                          slug="arith")
    bad, _ = env_services.version_create(actor=system, environment=env,
                                         spec={"task": "arithmetic", "ops": ["/"]})
    env_services.record_qc(actor=system, version=bad, passed=False,
                           report={"reason": "reference answers fail their own verifier"})
    # The run trains on this version's tasks (the built-in arithmetic environment), less
    # the one its QC quarantined.
    good, _ = env_services.version_create(actor=system, environment=env, spec={
        "env": {"source": "builtin", "name": "arithmetic", "params": {"eval_size": 4}}})
    env_services.record_qc(actor=system, version=good, passed=True,
                           report={"passed": True, "quarantined_ids": ["0+0"]})
    return token, worker_token, bad, good


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-4000:] if path.exists() else "(no log)"


def test_killed_worker_run_resumes_elsewhere_then_a_run_from_its_checkpoint_is_canceled(
        live_server, start_worker, settings, tmp_path):
    pytest.importorskip("deepspeed")
    # Short leases so the dead worker's run is swept within seconds (heartbeats: lease / 3).
    settings.CRUCIBLE = {**settings.CRUCIBLE, "LEASE_SECONDS": 8}
    token, worker_token, bad_env, good_env = _setup()
    store = open_store(django_settings.OBJECT_STORE_URL)
    log_a, log_b = tmp_path / "worker-a.log", tmp_path / "worker-b.log"

    with CrucibleClient(live_server.url, token) as client:
        client.create_dataset("ft", "sft", "demo")
        data = client.upload_version("ft", "sft", SFT_RECORDS)

        # A version that failed QC is refused, naming it and why; nothing is created.
        with pytest.raises(ApiError) as refused:
            client.launch_run("ft", project="demo", kind="train", config=TINY,
                              environments=["arith@v1"])
        assert refused.value.status == 400 and refused.value.code == "qc_not_passed"
        assert "arith@v1 failed QC: reference answers fail their own verifier" in \
            refused.value.message

        run = client.launch_run("ft", project="demo", kind="train", name="survivor",
                                config={**TINY, "sft": {"steps": 2}},
                                environments=["arith@v2"], datasets=["sft"])
        assert run["pool"] == "gpu" and run["max_attempts"] == 3
        rid = run["id"]
        worker_a = start_worker(worker_token, queues="gpu", log=log_a)

        # Kill the worker once the run has a checkpoint, well before its last step.
        def first_checkpoint():
            if worker_a.poll() is not None:
                raise AssertionError(f"worker A exited early:\n{_tail(log_a)}")
            return client.run_checkpoints("ft", rid)

        wait_for(first_checkpoint, timeout=300, what="the first checkpoint")
        holder = client.run("ft", rid)["lease_holder"]
        worker_a.send_signal(signal.SIGKILL)
        worker_a.wait(timeout=30)
        assert holder.endswith(f":{worker_a.pid}"), (holder, worker_a.pid)
        killed = client.run("ft", rid)
        assert killed["status"] == "running", killed
        stored_before = MetricPoint.objects.filter(run_id=rid, name="reward_mean").count()
        assert stored_before < STEPS

        # While the run waits to be resumed, an evaluation starts from its newest checkpoint
        # (on a pool no worker here serves, so it stays queued): checkpoint.keep = 1 must
        # not delete the object it points to when the resumed run checkpoints again.
        pinned = max(c["step"] for c in client.run_checkpoints("ft", rid)
                     if c["pruned_at"] is None)
        evaluation = client.launch_run("ft", project="demo", kind="eval", pool="sandbox",
                                       environment="arith@v2",
                                       base_model=f"run:{rid}@{pinned}", config={})

        # A fresh worker process (with the beat that sweeps expired leases) takes over.
        worker_b = start_worker(worker_token, queues="gpu,cpu", log=log_b,
                                beat=tmp_path / "beat-schedule",
                                extra_env={"CRUCIBLE_SWEEP_SECONDS": "1"})
        try:
            done = client.wait_for_run("ft", rid, timeout=300)
        except TimeoutError:
            raise AssertionError(_tail(log_b)) from None
        assert done["status"] == "succeeded", (done["error"], _tail(log_b))
        assert done["attempt"] == 2
        first, second = done["attempts"]
        assert (first["outcome"], second["outcome"]) == ("lost", "succeeded")
        assert first["worker"] == holder and "expired" in first["error"]
        assert second["worker"].endswith(f":{worker_b.pid}")

        messages = [e["message"] for e in client.run_events("ft", rid)["results"]]
        resumed = [m for m in messages if m.startswith("attempt 2: resuming from the checkpoint")]
        assert len(resumed) == 1, messages
        assert "environment arith v2: 95 train / 4 eval tasks, 1 quarantined by QC" in messages
        # The pinned dataset is read for the SFT warm start (by the attempt that ran SFT).
        assert "dataset sft@v1: 9 sft records for the warm start" in messages

        # Steps continue the numbering: every step once per series, no point stored twice.
        points = list(MetricPoint.objects.filter(run_id=rid).values_list("name", "step"))
        assert [k for k, n in Counter(points).items() if n > 1] == []
        rewards = sorted(step for name, step in points if name == "reward_mean")
        assert rewards == list(range(1, STEPS + 1))
        assert sorted(step for name, step in points if name == "sft/loss") == [0, 1]

        # Checkpoints are objects in the store, each a complete training state. keep = 1
        # applies there too: the newest stays, and the one the evaluation starts from; the
        # others' objects are deleted (their rows stay, marked pruned).
        checkpoints = client.run_checkpoints("ft", rid)
        assert [c["step"] for c in checkpoints] == list(range(2, STEPS + 1, 2))
        live = [c["step"] for c in checkpoints if c["pruned_at"] is None]
        assert live == sorted({pinned, STEPS}), (live, pinned)
        for ckpt in checkpoints:
            assert ckpt["uri"].startswith(store.url + "/") and ckpt["resumable"]
            assert store.exists(ckpt["uri"]) == (ckpt["pruned_at"] is None), ckpt
        assert client.run("ft", evaluation["id"])["base_model"]["step"] == pinned
        client.cancel_run("ft", evaluation["id"])
        archive = tmp_path / "last.tar"
        archive.write_bytes(store.get_bytes(checkpoints[-1]["uri"]))
        with tarfile.open(archive) as tar:
            names = set(tar.getnames())
        assert {"state.json", "hf/config.json", "hf/model.safetensors"} <= names

        # Lineage: the last checkpoint traces back to the run's environment and dataset.
        last = checkpoints[-1]
        graph = client.lineage("ft", f"checkpoint:{last['id']}")
        edges = {(e["source"]["type"], e["source"]["id"], e["relation"], e["target"]["type"],
                  e["target"]["id"]) for e in graph["edges"]}
        assert ("run", rid, "produced", "checkpoint", str(last["id"])) in edges
        assert ("environment_version", good_env.digest, "environment", "run", rid) in edges
        assert ("dataset_version", data["digest"], "input", "run", rid) in edges
        assert bad_env.digest not in {n["id"] for n in graph["nodes"]}

        # A second run starts from that checkpoint (pinned at launch), then is canceled.
        child = client.launch_run(
            "ft", project="demo", kind="train", name="child", base_model=f"run:{rid}",
            environments=["arith"],
            config={"rollout": TINY["rollout"],
                    "trainer": {**TINY["trainer"], "steps": 200},
                    "checkpoint": {"every": 1, "keep": 1}})
        assert child["base_model"]["checkpoint"] == last["id"]
        assert child["config"]["model"]["path"] == last["uri"]
        assert child["config"]["tokenizer"]["source"] == "model"
        cid = child["id"]
        wait_for(lambda: client.run("ft", cid)["status"] in ("succeeded", "failed")
                 or client.run_checkpoints("ft", cid), timeout=300,
                 what="the child run's first checkpoint")
        assert client.run("ft", cid)["status"] == "running", _tail(log_b)
        canceled = client.cancel_run("ft", cid)
        assert canceled["status"] == "canceled"
        # The worker notices at its next report and stops; its checkpoints stay.
        wait_for(lambda: "'stopped'" in log_b.read_text(errors="replace"), timeout=120,
                 what="the worker to stop the canceled run")
        after = client.run("ft", cid)
        assert after["status"] == "canceled" and after["attempts"][0]["outcome"] == "canceled"
        kept = [c for c in client.run_checkpoints("ft", cid) if c["pruned_at"] is None]
        assert len(kept) == 1 and store.exists(kept[0]["uri"])  # keep = 1
        steps = sorted(s for (s,) in MetricPoint.objects.filter(
            run_id=cid, name="reward_mean").values_list("step"))
        assert steps and steps == list(range(1, len(steps) + 1)) and len(steps) < 200

        child_graph = client.lineage("ft", f"run:{cid}")
        child_edges = {(e["source"]["type"], e["source"]["id"], e["relation"])
                       for e in child_graph["edges"] if e["target"]["id"] == cid}
        assert ("checkpoint", str(last["id"]), "base_model") in child_edges
        # ... and through it, upstream to the first run's inputs.
        assert data["digest"] in {n["id"] for n in child_graph["nodes"]}
