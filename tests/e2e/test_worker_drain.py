"""Graceful worker shutdown: SIGTERM to a real Celery worker mid-run drains it. Its train run
checkpoints the last completed step, the attempt ends ``drained``, the run is queued again at
once (the lease is far from expiring and no sweep runs), the worker exits by itself (status
0, not the drain watchdog's 75), and a second worker resumes right after that step: every
step trained and stored once. The run's goodput then equals what its recorded timestamps
give by hand.

``pool`` covers the prefork pool (what ``manage.py up`` and the images run: the task runs in
a child, told by the main process with SIGUSR2) and the solo pool (the task in the process
that got the signal). Runs on both configurations: filesystem broker + SQLite, and Redis +
PostgreSQL.
"""

from __future__ import annotations

import re
import signal
from collections import Counter
from datetime import datetime
from pathlib import Path

import pytest

from apps.metrics.models import MetricPoint
from apps.runs.models import Run
from tests.e2e.conftest import tenant, wait_for
from workers.client import CrucibleClient

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(900)]

STEPS = 120
CONFIG = {
    "model": {"preset": {"num_layers": 1}},
    "rollout": {"group_size": 2, "max_new_tokens": 2},
    "trainer": {"steps": STEPS, "prompts_per_step": 2, "micro_batch_size": 4,
                "zero_stage": 0, "eval_samples": 1},
    # Longer than the run: the only checkpoint before the final export is the drain's.
    "checkpoint": {"every": 1000, "keep": 1},
}
DRAIN_TIMEOUT_S = 240  # generous: a loaded machine; the watchdog must not be what ends it


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-4000:] if path.exists() else "(no log)"


def _t(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


@pytest.mark.parametrize("pool", [("-P", "prefork", "-c", "1"), ("-P", "solo")],
                         ids=["prefork", "solo"])
def test_sigterm_drains_a_train_run_which_another_worker_resumes(
        live_server, start_worker, settings, tmp_path, pool):
    pytest.importorskip("deepspeed")
    # A lease far longer than the test: a requeue can only come from the drain.
    settings.CRUCIBLE = {**settings.CRUCIBLE, "LEASE_SECONDS": 3600}
    token, worker_token = tenant("drain")
    env = {"CRUCIBLE_DRAIN_TIMEOUT_S": str(DRAIN_TIMEOUT_S)}
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"

    with CrucibleClient(live_server.url, token) as client:
        rid = client.launch_run("drain", project="demo", kind="train", config=CONFIG)["id"]
        first = start_worker(worker_token, queues="gpu", log=first_log, extra_env=env,
                             pool=pool)

        def training() -> bool:
            if first.poll() is not None:
                raise AssertionError(f"the worker exited early:\n{_tail(first_log)}")
            return MetricPoint.objects.filter(run_id=rid, name="loss").exists()

        wait_for(training, timeout=300, what="the first RL step")
        first.send_signal(signal.SIGTERM)
        code = first.wait(timeout=DRAIN_TIMEOUT_S + 60)
        assert code == 0, f"exit status {code}:\n{_tail(first_log)}"

        # Requeued by the drain itself, at once: the lease has an hour to go.
        run = Run.objects.get(pk=rid)
        assert run.status == "queued", (run.status, _tail(first_log))
        assert run.lease_id == "" and run.preemptions == 0
        drained = run.attempts.get()
        assert drained.outcome == "drained"
        assert drained.error.startswith("drained: ")
        stop = run.checkpoints.get()
        assert re.search(r"/checkpoints/epoch-1/step-0*(\d+)\.tar$", stop.uri)
        assert 1 <= stop.step < STEPS and stop.resumable

        start_worker(worker_token, queues="gpu", log=second_log, pool=pool)
        try:
            done = client.wait_for_run("drain", rid, timeout=400)
        except TimeoutError:
            raise AssertionError(_tail(second_log)) from None
        assert done["status"] == "succeeded", (done["error"], _tail(second_log))
        one, two = done["attempts"]
        assert (one["outcome"], two["outcome"]) == ("drained", "succeeded")
        assert (one["resume_step"], two["resume_step"]) == (0, stop.step)
        # The drain gave the attempt back: two attempts, none counted against max_attempts.
        assert Run.objects.get(pk=rid).retry_base == 1

        # Every step trained and stored once: the second attempt began right after the stop.
        points = list(MetricPoint.objects.filter(run_id=rid).values_list("name", "step"))
        assert [k for k, n in Counter(points).items() if n > 1] == []
        assert sorted(s for n, s in points if n == "loss") == list(range(1, STEPS + 1))

        # Goodput by hand from the recorded timestamps: attempt 1 keeps its work up to the
        # drain's checkpoint, attempt 2 all of its work; wall time from the first claim.
        ckpt = next(c for c in client.run_checkpoints("drain", rid) if c["step"] == stop.step)
        useful = (_t(ckpt["created_at"]) - _t(one["started_at"])) + \
            (_t(two["ended_at"]) - _t(two["started_at"]))
        wall = _t(done["finished_at"]) - _t(one["claimed_at"])
        g = done["goodput"]
        assert (g["useful_s"], g["wall_s"]) == (useful, wall)
        assert g["goodput"] == useful / wall < 1
        assert g["lost_preemption_s"] == _t(one["ended_at"]) - _t(ckpt["created_at"]) > 0
        assert g["queued_s"] == (_t(two["claimed_at"]) - _t(one["ended_at"])) + \
            (_t(done["finished_at"]) - _t(two["ended_at"]))
        assert g["lost_failure_s"] == 0
