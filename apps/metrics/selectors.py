"""Metric reads. Downsampling happens in the database: each series is cut into at most
N equal step ranges and each range returns its min, max and last value, so a chart of a
million-point series moves N rows, not a million."""

from __future__ import annotations

from typing import Any

from django.db import connection

from apps.metrics.models import MetricPoint

_DOWNSAMPLE_SQL = """
WITH bounds AS (
    SELECT MIN(step) AS lo, MAX(step) AS hi
    FROM {table} WHERE run_id = %(run)s AND name = %(name)s
),
bucketed AS (
    SELECT p.id, p.step, p.value,
           CAST(FLOOR((p.step - b.lo) * (%(n)s * 1.0) / (b.hi - b.lo + 1.0)) AS BIGINT) AS bucket
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


def metric_names(run_id: object) -> list[str]:
    return list(
        MetricPoint.objects.filter(run_id=run_id).values_list("name", flat=True).distinct()
        .order_by("name")
    )


def series(run_id: object, name: str, *, max_points: int) -> list[dict[str, Any]]:
    """``[{"step", "min", "max", "last", "count"}]`` with at most ``max_points`` rows; the
    step of a bucket is that of its last point."""
    table = MetricPoint._meta.db_table
    run_param = run_id.hex if connection.vendor == "sqlite" else run_id
    sql = _DOWNSAMPLE_SQL.format(table=table)
    with connection.cursor() as cursor:
        cursor.execute(sql, {"run": run_param, "name": name, "n": max_points})
        rows = cursor.fetchall()
    return [
        {"step": step, "min": vmin, "max": vmax, "last": last, "count": count}
        for step, vmin, vmax, last, count in rows
    ]
