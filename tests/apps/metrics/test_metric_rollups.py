"""Rollups: the pure fold against hand-computed values, and rollup-based reads against
an exact computation over the raw points."""

from __future__ import annotations

import math

import pytest

from apps.metrics import rollups
from apps.metrics.models import MetricRollup, MetricSeries
from apps.metrics.selectors import series
from tests.factories import DatasetFactory, make_run


def test_aggregate_by_hand():
    rows = [("loss", 0, 5.0, 100), ("loss", 63, 1.0, 163), ("loss", 64, 7.0, 164),
            ("loss", 10, 9.0, 110), ("kl", 3, 0.5, 103)]
    buckets, spans = rollups.aggregate(rows, widths=(64,))
    # steps 0, 63, 10 share bucket 0: min 1, max 9, last = value at step 63, count 3
    # (the last point's wall time goes with it)
    assert buckets[("loss", 64, 0)] == [1.0, 9.0, 63, 1.0, 3, 163]
    assert buckets[("loss", 64, 1)] == [7.0, 7.0, 64, 7.0, 1, 164]
    assert buckets[("kl", 64, 0)] == [0.5, 0.5, 3, 0.5, 1, 103]
    assert spans == {"loss": [4, 0, 64], "kl": [1, 3, 3]}


@pytest.mark.parametrize(("span", "n", "expected"), [
    (1_000, 10, None),          # short: exact buckets from the points
    (1_000_000, 1000, 64),      # 15,625 rows of width 64 for 1000 buckets
    (10_000_000, 1000, 1024),   # 9,765 rows of width 1024
    (100, 1000, None),
    (100_000, 1000, 64),        # past RAW_SCAN_LIMIT: 1,562 rows of width 64, fan-in 1
    (40_000, 1000, None),       # under it: exact buckets from 40k points
])
def test_pick_width(span, n, expected):
    assert rollups.pick_width(span, n) == expected


def _ingest(worker, run, lease, values, batch=2000):
    for seq, start in enumerate(range(0, len(values), batch), start=1):
        points = [{"name": "reward", "step": s, "value": values[s]}
                  for s in range(start, min(start + batch, len(values)))]
        r = worker.post(f"/api/v1/worker/runs/{run.pk}/metrics", {"seq": seq, "points": points},
                        **lease)
        assert r.status_code == 200, r.content


def test_rollup_read_matches_the_points_and_rebuild_matches_ingest(worker, project):
    run = make_run(project, DatasetFactory(project=project, team=project.team, slug="d"))
    claim = worker.post("/api/v1/worker/claim", {"pool": "cpu", "worker_id": "w"}).json()
    lease = {"HTTP_X_CRUCIBLE_LEASE": claim["lease_id"]}
    values = [math.sin(s / 500) + (s % 97) / 1000 for s in range(40_000)]
    _ingest(worker, run, lease, values)

    info = MetricSeries.objects.get(run=run, name="reward")
    assert (info.count, info.first_step, info.last_step) == (40_000, 0, 39_999)
    got = series(run.pk, "reward", max_points=5)  # 40,000 / 64 = 625 rows ≥ 8 × 5: rollups
    assert len(got) == 5
    assert sum(b["count"] for b in got) == 40_000
    assert min(b["min"] for b in got) == pytest.approx(min(values))
    assert max(b["max"] for b in got) == pytest.approx(max(values))
    assert got[-1]["step"] == 39_999 and got[-1]["last"] == pytest.approx(values[-1])
    steps = [b["step"] for b in got]
    assert steps == sorted(steps)
    # Each bucket's edges are within one rollup row (64 steps) of the exact split.
    for i, b in enumerate(got):
        assert abs(b["step"] - ((i + 1) * 8000 - 1)) < 64

    before = sorted(MetricRollup.objects.filter(run=run).values_list(
        "width", "bucket", "vmin", "vmax", "last_step", "last_value", "last_wall", "count"))
    rollups.rebuild(run.pk)
    after = sorted(MetricRollup.objects.filter(run=run).values_list(
        "width", "bucket", "vmin", "vmax", "last_step", "last_value", "last_wall", "count"))
    assert after == before
