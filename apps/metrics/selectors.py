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
    SELECT p.id, p.step, p.value, p.wall_time,
           CAST(FLOOR(CAST(p.step - b.lo AS DOUBLE PRECISION) * %(n)s / (b.hi - b.lo + 1))
                AS BIGINT) AS bucket
    FROM {table} p CROSS JOIN bounds b
    WHERE p.run_id = %(run)s AND p.name = %(name)s
),
ranked AS (
    SELECT bucket, step, value, wall_time,
           MIN(value) OVER (PARTITION BY bucket) AS vmin,
           MAX(value) OVER (PARTITION BY bucket) AS vmax,
           COUNT(*) OVER (PARTITION BY bucket) AS cnt,
           ROW_NUMBER() OVER (PARTITION BY bucket ORDER BY step DESC, id DESC) AS rn
    FROM bucketed
)
SELECT step, vmin, vmax, value, cnt, wall_time FROM ranked WHERE rn = 1 ORDER BY step
"""


# Rollup rows of one width grouped into the requested buckets; each bucket's last point is
# its rollup row with the largest last_step (unique within a width), joined back, so the
# query needs no window or array functions and runs on SQLite too. The wall time comes from
# the rollup row itself: reads never touch raw points, which retention may have dropped.
_ROLLUP_SQL = """
SELECT r.name, r.last_step, g.gmin, g.gmax, r.last_value, g.gcount, r.last_wall
FROM (
    SELECT r.name, r.width, MAX(r.last_step) AS ls, MIN(r.vmin) AS gmin, MAX(r.vmax) AS gmax,
           CAST(SUM(r.count) AS BIGINT) AS gcount
    FROM {requests} JOIN {table} r
      ON r.run_id = %(run)s AND r.name = q.name AND r.width = q.width
    GROUP BY r.name, r.width,
             CAST(FLOOR(CAST(r.last_step - q.lo AS DOUBLE PRECISION) * %(n)s
                        / (q.hi - q.lo + 1)) AS BIGINT)
) g JOIN {table} r
  ON r.run_id = %(run)s AND r.name = g.name AND r.width = g.width AND r.last_step = g.ls
ORDER BY r.name, r.last_step
"""
# PostgreSQL: every series of a request in one statement, its (name, width, lo, hi) as arrays.
_REQUESTS_PG = ("unnest(%(names)s::text[], %(widths)s::int4[], %(los)s::int8[], "
                "%(his)s::int8[]) AS q(name, width, lo, hi)")
# Elsewhere one series per statement.
_REQUEST_ONE = "(SELECT %(name)s AS name, %(width)s AS width, %(lo)s AS lo, %(hi)s AS hi) q"


def metric_names(run_id: object) -> list[str]:
    return list(
        MetricSeries.objects.filter(run_id=run_id).values_list("name", flat=True)
        .order_by("name")
    )


def series(run_id: object, name: str, *, max_points: int) -> list[dict[str, Any]]:
    """``[{"step", "min", "max", "last", "count", "wall"}]`` with at most ``max_points``
    rows; the step and wall time (unix seconds) of a bucket are those of its last point."""
    return series_many(run_id, [name], max_points=max_points)[name]


def series_many(run_id: object, names: list[str], *, max_points: int
                ) -> dict[str, list[dict[str, Any]]]:
    """:func:`series` of several metrics of a run. Those large enough to read from rollups are
    read together (one statement on PostgreSQL: 100 series of 100k points each merge ~160k
    rollup rows, not 10M points); small ones point by point; the rest bucketed from points."""
    run_param = run_id.hex if connection.vendor == "sqlite" else run_id  # type: ignore[attr-defined]
    infos = {s.name: s for s in MetricSeries.objects.filter(run_id=run_id, name__in=names)}
    out: dict[str, list[dict[str, Any]]] = {}
    from_rollups: list[tuple[str, int, int, int]] = []  # (name, width, lo, hi)
    for name in names:
        info = infos.get(name)
        if info is not None and info.count <= max_points and not info.pruned:
            out[name] = _every_point(run_id, name)
            continue
        width = None if info is None else pick_width(info.last_step - info.first_step + 1,
                                                     max_points, prefer_rollups=info.pruned)
        if width is None or info is None:
            out[name] = _from_points(run_param, name, max_points)
        else:
            from_rollups.append((name, width, info.first_step, info.last_step))
    if from_rollups:
        out.update(_from_rollups(run_param, from_rollups, max_points))
    return {name: out[name] for name in names}


def _from_points(run_param: object, name: str, max_points: int) -> list[dict[str, Any]]:
    with connection.cursor() as cursor:
        cursor.execute(_DOWNSAMPLE_SQL.format(table=MetricPoint._meta.db_table),
                       {"run": run_param, "name": name, "n": max_points})
        return [{"step": step, "min": vmin, "max": vmax, "last": last, "count": count,
                 "wall": wall} for step, vmin, vmax, last, count, wall in cursor.fetchall()]


def _from_rollups(run_param: object, requests: list[tuple[str, int, int, int]],
                  max_points: int) -> dict[str, list[dict[str, Any]]]:
    table = MetricRollup._meta.db_table
    found: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in requests}
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            names, widths, los, his = (list(c) for c in zip(*requests, strict=True))
            cursor.execute(_ROLLUP_SQL.format(requests=_REQUESTS_PG, table=table),
                           {"run": run_param, "n": max_points, "names": names,
                            "widths": widths, "los": los, "his": his})
            rows = cursor.fetchall()
        else:
            rows = []
            for name, width, lo, hi in requests:
                cursor.execute(_ROLLUP_SQL.format(requests=_REQUEST_ONE, table=table),
                               {"run": run_param, "n": max_points, "name": name,
                                "width": width, "lo": lo, "hi": hi})
                rows += cursor.fetchall()
    for name, step, vmin, vmax, last, count, wall in rows:
        found[name].append({"step": step, "min": vmin, "max": vmax, "last": last,
                            "count": count, "wall": wall})
    return found


def _every_point(run_id: object, name: str) -> list[dict[str, Any]]:
    """A series that fits in ``max_points``, point by point: one indexed range read instead
    of the windowed bucketing (5-10x cheaper for a 10,000-point series). A step logged more
    than once keeps its last value and counts its points, as a bucket would."""
    out: list[dict[str, Any]] = []
    rows = MetricPoint.objects.filter(run_id=run_id, name=name).order_by("step", "id") \
        .values_list("step", "value", "wall_time")
    for step, value, wall in rows.iterator(chunk_size=5000):
        if out and out[-1]["step"] == step:
            last = out[-1]
            last.update(min=min(last["min"], value), max=max(last["max"], value), last=value,
                        count=last["count"] + 1, wall=wall)
            continue
        out.append({"step": step, "min": value, "max": value, "last": value, "count": 1,
                    "wall": wall})
    return out


COLUMNS = ("step", "min", "max", "last", "count", "wall")


def as_columns(points: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The same rows as parallel arrays: a third of the JSON, and what a chart draws."""
    return {key: [p[key] for p in points] for key in COLUMNS}


def points_after(run_id: object, name: str, *, after_step: int, limit: int
                 ) -> tuple[list[dict[str, Any]], bool]:
    """The raw points of a series after ``after_step``, oldest first, at most ``limit`` (in the
    downsampled shape, each its own bucket), and whether more follow: a polling client asks
    again with the last step it got, reading only the index range it has not seen."""
    rows = list(MetricPoint.objects.filter(run_id=run_id, name=name, step__gt=after_step)
                .order_by("step", "id").values_list("step", "value")[: limit + 1])
    return ([{"step": step, "min": value, "max": value, "last": value, "count": 1}
             for step, value in rows[:limit]], len(rows) > limit)
