"""Rollups: the pure fold against hand-computed values, and rollup-based reads against
an exact computation over the raw points."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from apps.metrics import rollups, selectors
from apps.metrics.models import MetricRollup, MetricSeries
from apps.metrics.selectors import COLUMNS, as_points, series, series_columns, series_many
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


def _by_hand(points, width, max_points):
    """The rollup read computed from the raw points with plain Python: buckets of ``width``
    steps, each placed in the requested range of its last step, ranges merged."""
    buckets: dict[int, list] = {}
    for step, value, wall in points:  # in ingest order; a later point at a step wins
        b = buckets.setdefault(step // width, [value, value, step, value, 0, wall])
        b[0], b[1], b[4] = min(b[0], value), max(b[1], value), b[4] + 1
        if step >= b[2]:
            b[2], b[3], b[5] = step, value, wall
    lo = min(s for s, _, _ in points)
    hi = max(s for s, _, _ in points)
    out: dict[int, dict] = {}
    for _, (vmin, vmax, last_step, last, count, wall) in sorted(buckets.items()):
        g = min(math.floor(float(last_step - lo) * max_points / float(hi - lo + 1)),
                max_points - 1)
        o = out.setdefault(g, {"min": vmin, "max": vmax, "count": 0})
        o.update(min=min(o["min"], vmin), max=max(o["max"], vmax), count=o["count"] + count,
                 step=last_step, last=last, wall=wall)
    return {key: [o[key] for _, o in sorted(out.items())] for key in COLUMNS}


def test_rollup_reads_equal_a_downsample_by_hand(member, worker, project):
    """Two series in one request (one statement on PostgreSQL), with a gap, a step logged
    twice and negative values, against the same read computed in Python; through the API
    in both layouts."""
    run = make_run(project, DatasetFactory(project=project, team=project.team, slug="d"))
    claim = worker.post("/api/v1/worker/claim", {"pool": "cpu", "worker_id": "w"}).json()
    lease = {"HTTP_X_CRUCIBLE_LEASE": claim["lease_id"]}
    raw: dict[str, list] = {"loss": [], "reward": []}
    steps = [s for s in range(7000) if not 2000 <= s < 2300]  # a gap of 300 steps
    for seq, start in enumerate(range(0, len(steps), 2000), start=1):
        columns = {"name": [], "step": [], "value": [], "wall_time": []}
        for s in steps[start:start + 2000]:
            for name, value in (("loss", math.cos(s / 300) - s / 1e5),
                                ("reward", (s * 7919 % 1009) / 1009 - 0.5)):
                columns["name"].append(name)
                columns["step"].append(s + 5)  # first step 5, not 0
                columns["value"].append(value)
                columns["wall_time"].append(1.7e9 + s / 8)
                raw[name].append((s + 5, value, 1.7e9 + s / 8))
        r = worker.post(f"/api/v1/worker/runs/{run.pk}/metrics",
                        {"seq": seq, "columns": columns}, format="json", **lease)
        assert r.status_code == 200, r.content
    # Step 9005 logged again later: its bucket keeps the later value as its last.
    r = worker.post(f"/api/v1/worker/runs/{run.pk}/metrics",
                    {"seq": 99, "points": [{"name": "loss", "step": 9005, "value": -7.5,
                                            "wall_time": 1.8e9}]}, format="json", **lease)
    assert r.status_code == 200, r.content
    raw["loss"].append((9005, -7.5, 1.8e9))

    for n in (2, 7, 11):
        width = rollups.pick_width(7000, n)
        assert width == 64  # ≥ 8 rollup rows a bucket: read from rollups
        got = series_columns(run.pk, ["loss", "reward"], max_points=n)
        for name in ("loss", "reward"):
            want = _by_hand(raw[name], width, n)
            assert {k: list(v) for k, v in got[name].items()} == want, (name, n)
            assert len(want["step"]) <= n and sum(want["count"]) == len(raw[name])
        assert series_many(run.pk, ["reward"], max_points=n)["reward"] == \
            as_points(_by_hand(raw["reward"], width, n))

    url = f"/api/v1/teams/{project.team.slug}/runs/{run.pk}/metrics?max_points=7"
    cols = member.client.get(url + "&layout=columns").json()["series"]
    points = member.client.get(url).json()["series"]
    assert [s["name"] for s in cols] == ["loss", "reward"]
    for c, p in zip(cols, points, strict=True):
        assert c["columns"] == _by_hand(raw[c["name"]], 64, 7)
        assert p["points"] == as_points(c["columns"])


def test_merge_of_rollup_rows_by_hand():
    """The merge alone: two series, each row in the range of its last step."""
    table = [
        # (series, last step, min, max, last, count, wall), ordered by series then step
        (1, 3, 0.0, 1.0, 0.5, 4, 13.0),
        (1, 7, 2.0, 6.0, 2.5, 4, 17.0),
        (1, 11, -3.0, 0.0, -1.0, 4, 21.0),
        (2, 1, 5.0, 5.0, 5.0, 1, 11.0),
        (2, 9, -1.0, 4.0, 3.0, 2, 19.0),
    ]
    rows = {name: np.array([r[k] for r in table], dtype=kind)
            for k, (name, kind) in enumerate(selectors.ROW_FIELDS)}
    # Series 1 spans steps 0..11 in 2 ranges, [0, 6) and [6, 12); series 2 spans 1..9,
    # so step 1 is in range floor(0 * 2 / 9) = 0 and step 9 in floor(8 * 2 / 9) = 1.
    got = selectors.merge_rollups(rows, [(0, 11), (1, 9)], 2)
    assert {k: v.tolist() for k, v in got[0].items()} == {
        "step": [3, 11], "min": [0.0, -3.0], "max": [1.0, 6.0], "last": [0.5, -1.0],
        "count": [4, 8], "wall": [13.0, 21.0]}
    assert {k: v.tolist() for k, v in got[1].items()} == {
        "step": [1, 9], "min": [5.0, -1.0], "max": [5.0, 4.0], "last": [5.0, 3.0],
        "count": [1, 2], "wall": [11.0, 19.0]}
    empty = selectors.merge_rollups({name: np.empty(0, dtype=kind)
                                     for name, kind in selectors.ROW_FIELDS}, [(0, 5)], 10)
    assert [len(v) for v in empty[0].values()] == [0] * 6


def test_binary_array_reader():
    body = (struct.pack(">iiiii", 1, 0, 701, 3, 1)
            + b"".join(struct.pack(">id", 8, v) for v in (1.5, -2.0, 1e300)))
    assert selectors._from_binary_array(body, "f8").tolist() == [1.5, -2.0, 1e300]
    assert selectors._from_binary_array(memoryview(body), "f8").tolist() == [1.5, -2.0, 1e300]
    assert selectors._from_binary_array(None, "i8").tolist() == []
    with_null = struct.pack(">iiiii", 1, 1, 701, 1, 1) + struct.pack(">i", -1)
    with pytest.raises(ValueError):
        selectors._from_binary_array(with_null, "f8")
