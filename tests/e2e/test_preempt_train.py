"""A train run preempted through a real worker process: the scheduler's request (made here
through the service, as an admission pass would) reaches the worker in a heartbeat answer;
its engine checkpoints the last completed step under the attempt's lease epoch, the worker
reports ``preempted``, and the requeued run is claimed again (epoch 2), resuming right after
that step with every step trained once.

Runs on both configurations: filesystem broker + SQLite, and Redis + PostgreSQL.
"""

from __future__ import annotations

import re
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from apps.core.actor import Actor
from apps.metrics.models import MetricPoint
from apps.runs import services
from apps.runs.models import Run
from tests.e2e.conftest import tenant, wait_for
from workers.client import CrucibleClient

# One worker process imports torch and DeepSpeed: a minute or more on a loaded machine.
pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(900)]

# Long enough that the run cannot end before its worker's next heartbeat.
STEPS = 120
CONFIG = {
    "model": {"preset": {"num_layers": 1}},
    "rollout": {"group_size": 2, "max_new_tokens": 2},
    "trainer": {"steps": STEPS, "prompts_per_step": 2, "micro_batch_size": 4,
                "zero_stage": 0, "eval_samples": 1},
    # Longer than the run: the only checkpoint before the final export is the preemption's.
    "checkpoint": {"every": 1000, "keep": 1},
}


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-4000:] if path.exists() else "(no log)"


def test_a_preempted_run_checkpoints_then_resumes_after_its_last_step(
        live_server, start_worker, settings, tmp_path):
    pytest.importorskip("deepspeed")
    # Short leases: heartbeats every lease / 3 seconds carry the preemption quickly.
    settings.CRUCIBLE = {**settings.CRUCIBLE, "LEASE_SECONDS": 6}
    token, worker_token = tenant("pre")
    log = tmp_path / "worker.log"

    with CrucibleClient(live_server.url, token) as client:
        rid = client.launch_run("pre", project="demo", kind="train", config=CONFIG)["id"]
        worker = start_worker(worker_token, queues="gpu", log=log)

        def training() -> bool:
            if worker.poll() is not None:
                raise AssertionError(f"the worker exited early:\n{_tail(log)}")
            return MetricPoint.objects.filter(run_id=rid, name="loss").exists()

        wait_for(training, timeout=300, what="the first RL step")
        services.request_preemption(actor=Actor.system(), run=Run.objects.get(pk=rid),
                                    deadline=timezone.now() + timedelta(minutes=10),
                                    reason="room for a production run")
        try:
            done = client.wait_for_run("pre", rid, timeout=300)
        except TimeoutError:
            raise AssertionError(_tail(log)) from None
        assert done["status"] == "succeeded", (done["error"], _tail(log))

        run = Run.objects.get(pk=rid)
        assert (run.preemptions, run.lease_epoch) == (1, 2)
        first, second = done["attempts"]
        assert (first["outcome"], second["outcome"]) == ("preempted", "succeeded")
        # It stopped by itself (reported preempted), not at the deadline.
        assert first["error"] == "preempted by the scheduler (stopped)"

        # The preemption's checkpoint, under epoch 1, at a step before the end; the final
        # export under epoch 2.
        checkpoints = client.run_checkpoints("pre", rid)
        assert len(checkpoints) == 2, checkpoints
        stop, final = checkpoints
        assert re.search(r"/checkpoints/epoch-1/step-0*(\d+)\.tar$", stop["uri"])
        assert 1 <= stop["step"] < STEPS and stop["resumable"]
        assert final["uri"].endswith("/checkpoints/epoch-2/final.tar")
        assert final["step"] == STEPS

        events = client.run_events("pre", rid)["results"]
        messages = [e["message"] for e in events]
        assert f"preempted: stopped after step {stop['step']}, checkpointed" in messages
        assert any(m.startswith(f"attempt 2: resuming from the checkpoint at step "
                                f"{stop['step']}") for m in messages), messages
        # The checkpoint was recorded before the worker reported the preemption.
        seq = {(e["kind"], e["message"]): e["seq"] for e in events}
        preempted = next(e["seq"] for e in events if e["kind"] == "status"
                         and e["message"].startswith("preempted"))
        assert seq[("checkpoint", f"checkpoint at step {stop['step']}")] < preempted

        # Every step trained and stored once: the second attempt began right after the stop.
        points = list(MetricPoint.objects.filter(run_id=rid).values_list("name", "step"))
        assert [k for k, n in Counter(points).items() if n > 1] == []
        assert sorted(s for n, s in points if n == "loss") == list(range(1, STEPS + 1))

        # Goodput by hand from the recorded timestamps: attempt 1 keeps its work up to the
        # preemption's checkpoint, attempt 2 all of its work; wall time from the first claim.
        def t(value: str) -> float:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()

        assert (first["resume_step"], second["resume_step"]) == (0, stop["step"])
        useful = (t(stop["created_at"]) - t(first["started_at"])) + \
            (t(second["ended_at"]) - t(second["started_at"]))
        wall = t(done["finished_at"]) - t(first["claimed_at"])
        g = done["goodput"]
        assert (g["useful_s"], g["wall_s"]) == (useful, wall)
        assert g["goodput"] == useful / wall < 1
        assert g["lost_preemption_s"] == t(first["ended_at"]) - t(stop["created_at"])
        assert g["startup_s"] == (t(first["started_at"]) - t(first["claimed_at"])) + \
            (t(second["started_at"]) - t(second["claimed_at"]))
