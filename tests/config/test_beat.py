"""The beat runs the admission pass only with the scheduler on: off, its schedule is what it
was before the scheduler existed."""

from __future__ import annotations

import pytest

from config.celery import beat_schedule


def test_the_admission_pass_is_scheduled_only_with_the_scheduler_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CRUCIBLE_SCHEDULER", raising=False)
    assert set(beat_schedule()) == {"sweep-expired-leases", "prune-metric-points",
                                   "evaluate-alerts"}
    monkeypatch.setenv("CRUCIBLE_SCHEDULER", "true")
    monkeypatch.setenv("CRUCIBLE_ADMISSION_SECONDS", "2")
    entry = beat_schedule()["admission-pass"]
    assert entry["task"] == "workers.tasks.admission_pass" and entry["schedule"] == 2.0
    monkeypatch.setenv("CRUCIBLE_ADMISSION_SECONDS", "soon")
    with pytest.raises(ValueError, match="CRUCIBLE_ADMISSION_SECONDS"):
        beat_schedule()


def test_the_metric_prune_is_scheduled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRUCIBLE_METRIC_PRUNE_SECONDS", "600")
    entry = beat_schedule()["prune-metric-points"]
    assert entry["task"] == "workers.tasks.prune_metrics" and entry["schedule"] == 600.0
