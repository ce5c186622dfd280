"""The preemption policy's knobs come from settings (``CRUCIBLE_PREEMPT_MIN_RUNTIME_S``,
``CRUCIBLE_MAX_PREEMPTIONS``, ``CRUCIBLE_PREEMPT_MAX_LOSS_S``), and a run's minimum runtime
counts from the start of its current attempt: a run resumed after a preemption is not stopped
again the moment it restarts because its first attempt began long ago."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone

from apps.core.actor import Actor
from apps.projects.models import Project
from apps.runs import admission, services
from apps.runs.models import Run, RunStatus
from tests.apps.runs.test_admission import claim, gpu_node, gpu_run

SYSTEM = Actor.system()


@pytest.fixture
def on(settings: Any) -> None:
    settings.CRUCIBLE = {**settings.CRUCIBLE, "SCHEDULER": True, "PREEMPT_MIN_RUNTIME_S": 60,
                         "MAX_PREEMPTIONS": 2, "PREEMPT_MAX_LOSS_S": 3_600}


pytestmark = pytest.mark.usefixtures("on")


def start(run: Run, at: datetime) -> Run:
    """Claim and start ``run`` as if its worker did so at ``at``, with a lease far ahead."""
    run = claim(run)
    services.worker_transition(actor=SYSTEM, run=run, lease_id=run.lease_id, to="running")
    Run.objects.filter(pk=run.pk).update(claimed_at=at, lease_expires_at=at + timedelta(
        days=1))
    run.refresh_from_db()
    return run


def preempted_for(urgent: Run, now: datetime) -> list[str]:
    """Pass at ``now``; the runs it preempted to admit ``urgent``."""
    result = admission.admission_pass(now=now)
    return result["preempted"] if str(urgent.pk) in result["admitted"] else []


def test_the_knobs_come_from_settings() -> None:
    policy = admission.policy()
    assert (policy.min_runtime_s, policy.max_preemptions, policy.max_victim_loss_s) == (
        60.0, 2, 3_600.0)


def test_min_runtime_from_settings_decides_when_a_run_may_be_preempted(
        project: Project) -> None:
    gpu_node("n1", gpus=2)
    t0 = timezone.now()
    victim = gpu_run(project, gpus=2, priority_class="preemptible")
    admission.admission_pass(now=t0)
    victim = start(victim, t0)
    urgent = gpu_run(project, gpus=2, priority_class="production")
    assert preempted_for(urgent, t0 + timedelta(seconds=59)) == []
    assert preempted_for(urgent, t0 + timedelta(seconds=61)) == [str(victim.pk)]


def test_a_resumed_run_counts_its_min_runtime_from_its_new_attempt(project: Project) -> None:
    gpu_node("n1", gpus=2)
    t0 = timezone.now()
    victim = gpu_run(project, gpus=2, priority_class="preemptible")
    admission.admission_pass(now=t0)
    victim = start(victim, t0)
    first = gpu_run(project, gpus=2, priority_class="production")
    later = t0 + timedelta(minutes=30)
    assert preempted_for(first, later) == [str(victim.pk)]
    victim.refresh_from_db()
    services.finish_preemption(actor=SYSTEM, run=victim, forced=False)
    services.cancel(actor=SYSTEM, run=Run.objects.get(pk=first.pk))  # frees the GPUs again
    admission.admission_pass(now=later)
    victim.refresh_from_db()
    assert victim.status == RunStatus.QUEUED and victim.preemptions == 1
    victim = start(victim, later)  # attempt 2 starts; its first began 30 minutes ago
    assert victim.attempt == 2 and victim.started_at < later

    second = gpu_run(project, gpus=2, priority_class="production")
    assert preempted_for(second, later + timedelta(seconds=30)) == []
    assert preempted_for(second, later + timedelta(seconds=61)) == [str(victim.pk)]


def test_max_preemptions_from_settings_protects_a_run(project: Project) -> None:
    gpu_node("n1", gpus=2)
    t0 = timezone.now()
    victim = gpu_run(project, gpus=2, priority_class="preemptible")
    admission.admission_pass(now=t0)
    start(victim, t0)
    Run.objects.filter(pk=victim.pk).update(preemptions=2)  # the cap (2 here)
    urgent = gpu_run(project, gpus=2, priority_class="production")
    assert preempted_for(urgent, t0 + timedelta(minutes=50)) == []
