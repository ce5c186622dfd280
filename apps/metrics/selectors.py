"""Metric reads. Downsampling happens in the database: each series is cut into at most
N equal step ranges and each range returns its min, max and last value. (Bucket numbers are
computed in double precision: NUMERIC arithmetic made the grouping 3x slower, and 64-bit
integer products overflow for huge step ranges. FLOOR matters: PostgreSQL's cast to
BIGINT rounds.) Small series are
bucketed from their points; large ones from the rollups written at ingest (see
``rollups``), so a chart of a million-point series merges a few thousand rows, not a
million."""

from __future__ import annotations

from typing import Any

from django.db import connection

from apps.metrics.models import MetricPoint, MetricRollup, MetricSeries
from apps.metrics.rollups import pick_width

_DOWNSAMPLE_SQL = """
WITH bounds AS (
    SELECT MIN(step) AS lo, MAX(step) AS hi
    FROM {table} WHERE run_id = %(run)s AND name = %(name)s
),
bucketed AS (
    SELECT p.id, p.step, p.value,
           CAST(FLOOR(CAST(p.step - b.lo AS DOUBLE PRECISION) * %(n)s / (b.hi - b.lo + 1))
                AS BIGINT) AS bucket
    FROM {table} p CROSS JOIN bounds b
    WHERE p.run_id = %(run)s AND p.name = %(name)s
),
ranked AS (
    SELECT bucket, step, value,
           MIN(value) OVER (PARTITION BY bucket) AS vmin,
           MAX(value) OVER (PARTITION BY bucket) AS vmax,
           COUNT(*) OVER (PARTITION BY bucket) AS cnt,
           ROW_NUMBER() OVER (PARTITION BY bucket ORDER BY step DESC, id DESC) AS rn
    FROM bucketed
)
SELECT step, vmin, vmax, value, cnt FROM ranked WHERE rn = 1 ORDER BY step
"""


_ROLLUP_SQL = """
WITH grouped AS (
    SELECT r.last_step, r.last_value, r.vmin, r.vmax, r.count,
           CAST(FLOOR(CAST(r.last_step - %(lo)s AS DOUBLE PRECISION) * %(n)s
                / (%(hi)s - %(lo)s + 1)) AS BIGINT) AS grp
    FROM {table} r
    WHERE r.run_id = %(run)s AND r.name = %(name)s AND r.width = %(width)s
),
ranked AS (
    SELECT grp, last_step, last_value,
           MIN(vmin) OVER (PARTITION BY grp) AS gmin,
           MAX(vmax) OVER (PARTITION BY grp) AS gmax,
           SUM(count) OVER (PARTITION BY grp) AS gcount,
           ROW_NUMBER() OVER (PARTITION BY grp ORDER BY last_step DESC) AS rn
    FROM grouped
)
SELECT last_step, gmin, gmax, last_value, gcount FROM ranked WHERE rn = 1 ORDER BY last_step
"""


def metric_names(run_id: object) -> list[str]:
    return list(
        MetricSeries.objects.filter(run_id=run_id).values_list("name", flat=True)
        .order_by("name")
    )


def series(run_id: object, name: str, *, max_points: int) -> list[dict[str, Any]]:
    """``[{"step", "min", "max", "last", "count"}]`` with at most ``max_points`` rows; the
    step of a bucket is that of its last point."""
    run_param = run_id.hex if connection.vendor == "sqlite" else run_id
    info = MetricSeries.objects.filter(run_id=run_id, name=name).first()
    width = None
    if info is not None and info.count > max_points:
        width = pick_width(info.last_step - info.first_step + 1, max_points)
    if width is None:
        sql = _DOWNSAMPLE_SQL.format(table=MetricPoint._meta.db_table)
        params: dict[str, Any] = {"run": run_param, "name": name, "n": max_points}
    else:
        sql = _ROLLUP_SQL.format(table=MetricRollup._meta.db_table)
        params = {"run": run_param, "name": name, "n": max_points, "width": width,
                  "lo": info.first_step, "hi": info.last_step}
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    return [
        {"step": step, "min": vmin, "max": vmax, "last": last, "count": count}
        for step, vmin, vmax, last, count in rows
    ]


def points_after(run_id: object, name: str, *, after_step: int, limit: int
                 ) -> tuple[list[dict[str, Any]], bool]:
    """The raw points of a series after ``after_step``, oldest first, at most ``limit`` (in the
    downsampled shape, each its own bucket), and whether more follow: a polling client asks
    again with the last step it got, reading only the index range it has not seen."""
    rows = list(MetricPoint.objects.filter(run_id=run_id, name=name, step__gt=after_step)
                .order_by("step", "id").values_list("step", "value")[: limit + 1])
    return ([{"step": step, "min": value, "max": value, "last": value, "count": 1}
             for step, value in rows[:limit]], len(rows) > limit)
