"""A team's usage as database rows, for the API, page and browser tests: the hand-computed
timeline of test_accounting's preemption (steps of 360 s instead of 10 s) on a node of 8
H100s, starting 2026-03-02 20:00 UTC so it spans two days, a CPU-only run with the
scheduler off, and another team's run that must never show.

Per GPU (seconds after 20:00): admitted 0; attempt 1 claimed 360, began 1080, step-50
checkpoint 19080, preempted at step 70 (26280), allocation released 26460; re-admitted and
claimed 28800, resumed from step 50 and began 30240, succeeded 48240 (released then).
useful 36000 s (10 h), startup 720 s, restart 1440 s, lost to the preemption 7200 s (the
20 steps 51-70), held 360 + 180 s: 12.75 h allocated. x 8 GPUs: 102 GPU-h, 80 useful.
Day 1 (20:00-24:00, 14400 s): held 360, startup 720, useful 13320 per GPU: 32 GPU-h
allocated, 29.6 useful; day 2 the rest: 70 allocated, 50.4 useful.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from apps.metrics.models import MetricBatch, MetricPoint
from apps.projects.models import Project
from apps.runs.models import Checkpoint, Run, RunAttempt
from apps.scheduling.models import Allocation, Node
from tests.factories import make_run

BASE = datetime(2026, 3, 2, 20, 0, tzinfo=UTC)
RATES = {"H100": 2.5, "cpu": 0.05}
H100 = {"gpus_per_node": 8, "nodes": 1, "gpu_types": ["H100"], "cpus": 16}


def at(seconds: float) -> datetime:
    return BASE + timedelta(seconds=seconds)


def preempted_gpu_run(project: Project, dataset: Any, node: Node, name: str) -> Run:
    run = make_run(project, dataset, name=name)
    Run.objects.filter(pk=run.pk).update(
        status="succeeded", attempt=2, resources=H100, created_at=at(-60),
        finished_at=at(48240))
    RunAttempt.objects.create(run=run, number=1, outcome="preempted", claimed_at=at(360),
                              started_at=at(1080), ended_at=at(26280), resume_step=0)
    RunAttempt.objects.create(run=run, number=2, outcome="succeeded", claimed_at=at(28800),
                              started_at=at(30240), ended_at=at(48240), resume_step=50)
    Checkpoint.objects.create(run=run, team=run.team, step=50, resumable=True,
                              uri="file:///x/step-50.tar", created_at=at(19080))
    for start, end in ((0, 26460), (28800, 48240)):
        Allocation.objects.create(run=run, node=node, gpu_ids=list(range(8)), flavor="H100",
                                  created_at=at(start), released_at=at(end))
    # The trainer's idle fractions: the learner waited a quarter of each step on average.
    MetricPoint.objects.bulk_create(
        MetricPoint(run=run, name=name_, step=step, value=value, wall_time=0.0)
        for step, (name_, value) in enumerate([("async/learner_idle", 0.2),
                                               ("async/learner_idle", 0.3),
                                               ("async/generator_idle", 0.5)]))
    # Attempt 1 reported steps up to 70 (its last batch, received just before the stop);
    # attempt 2 resumed from 50, so steps 51-70 were trained twice.
    for seq, (step, received) in enumerate(((60, 22000), (70, 26200)), start=1):
        point = MetricPoint.objects.create(run=run, name="loss", step=step, value=0.1,
                                           wall_time=0.0)
        MetricBatch.objects.create(run=run, seq=seq, first_id=point.pk, last_id=point.pk,
                                   point_count=1, received_at=at(received))
    return run


def build(project: Project, dataset: Any, rival_project: Project | None = None,
          ) -> dict[str, Run]:
    node = Node.objects.create(name="h100-a", pool="gpu", gpu_type="H100", gpu_count=8,
                               cpus=64)
    gpu = preempted_gpu_run(project, dataset, node, "grpo-preempted")
    # CPU work with the scheduler off: 4 cores for an hour, from 21:00.
    cpu = make_run(project, dataset, name="qc-cpu")
    Run.objects.filter(pk=cpu.pk).update(status="succeeded", attempt=1, created_at=at(0),
                                         resources={"gpus_per_node": 0, "cpus": 4},
                                         finished_at=at(7200))
    RunAttempt.objects.create(run=cpu, number=1, outcome="succeeded", claimed_at=at(3600),
                              started_at=at(3600), ended_at=at(7200), resume_step=0)
    # A run queued and never admitted holds nothing and is left out.
    make_run(project, dataset, name="never-ran")
    runs = {"gpu": gpu, "cpu": cpu}
    if rival_project is not None:
        runs["rival"] = preempted_gpu_run(rival_project, None, node, "rival-run")
    return runs
