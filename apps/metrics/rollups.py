"""Multi-resolution rollups of metric series, maintained at ingest.

Each point lands in one bucket per width in ``WIDTHS`` (bucket = step // width); a bucket
keeps min, max, the value at its largest step, and a count. Reads pick the finest width
that keeps the row count small and merge those rows down to the requested resolution in
SQL. Writes are one upsert statement per batch.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db import connection

from apps.metrics.models import MetricPoint, MetricRollup, MetricSeries

WIDTHS: tuple[int, ...] = (64, 1024, 16384, 262144)

Row = tuple[str, int, float, float]  # (name, step, value, wall_time)
# (name, width, bucket) -> [vmin, vmax, last_step, last_value, count, last_wall]
Buckets = dict[tuple[str, int, int], list]
# name -> [count, first_step, last_step]
Spans = dict[str, list[int]]


def aggregate(rows: Iterable[Row], widths: tuple[int, ...] = WIDTHS) -> tuple[Buckets, Spans]:
    """Pure: fold a batch into per-bucket aggregates and per-series spans."""
    buckets: Buckets = {}
    spans: Spans = {}
    for name, step, value, wall in rows:
        span = spans.get(name)
        if span is None:
            spans[name] = [1, step, step]
        else:
            span[0] += 1
            span[1] = min(span[1], step)
            span[2] = max(span[2], step)
        for width in widths:
            key = (name, width, step // width)
            agg = buckets.get(key)
            if agg is None:
                buckets[key] = [value, value, step, value, 1, wall]
                continue
            agg[0] = min(agg[0], value)
            agg[1] = max(agg[1], value)
            if step >= agg[2]:
                agg[2], agg[3], agg[5] = step, value, wall
            agg[4] += 1
    return buckets, spans


def _least_greatest() -> tuple[str, str]:
    # SQLite's scalar MIN/MAX take several arguments; PostgreSQL spells them LEAST/GREATEST.
    return ("MIN", "MAX") if connection.vendor == "sqlite" else ("LEAST", "GREATEST")


def upsert(run_id: object, rows: list[Row]) -> None:
    """Fold ``rows`` into the series and rollup tables (inside the caller's transaction)."""
    buckets, spans = aggregate(rows)
    least, greatest = _least_greatest()
    run_value = run_id.hex if connection.vendor == "sqlite" else run_id  # type: ignore[attr-defined]
    series_table = MetricSeries._meta.db_table
    rollup_table = MetricRollup._meta.db_table
    with connection.cursor() as cursor:
        values = ", ".join(["(%s, %s, %s, %s, %s)"] * len(spans))
        params: list = []
        for name, (count, first, last) in spans.items():
            params += [run_value, name, count, first, last]
        cursor.execute(
            f"INSERT INTO {series_table} AS t (run_id, name, count, first_step, last_step) "
            f"VALUES {values} ON CONFLICT (run_id, name) DO UPDATE SET "
            f"count = t.count + excluded.count, "
            f"first_step = {least}(t.first_step, excluded.first_step), "
            f"last_step = {greatest}(t.last_step, excluded.last_step)",
            params,
        )
        values = ", ".join(["(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"] * len(buckets))
        params = []
        for (name, width, bucket), (vmin, vmax, last_step, last_value, count, last_wall) \
                in buckets.items():
            params += [run_value, name, width, bucket, vmin, vmax, last_step, last_value,
                       last_wall, count]
        cursor.execute(
            f"INSERT INTO {rollup_table} AS t (run_id, name, width, bucket, vmin, vmax, "
            f"last_step, last_value, last_wall, count) VALUES {values} "
            f"ON CONFLICT (run_id, name, width, bucket) DO UPDATE SET "
            f"vmin = {least}(t.vmin, excluded.vmin), vmax = {greatest}(t.vmax, excluded.vmax), "
            f"last_value = CASE WHEN excluded.last_step >= t.last_step "
            f"THEN excluded.last_value ELSE t.last_value END, "
            f"last_wall = CASE WHEN excluded.last_step >= t.last_step "
            f"THEN excluded.last_wall ELSE t.last_wall END, "
            f"last_step = {greatest}(t.last_step, excluded.last_step), "
            f"count = t.count + excluded.count",
            params,
        )


def rebuild(run_id: object) -> None:
    """Recompute a run's series and rollups from its points, in SQL (for data loaded
    around the ingest path: migrations, bulk imports, benchmarks)."""
    run_value = run_id.hex if connection.vendor == "sqlite" else run_id  # type: ignore[attr-defined]
    points = MetricPoint._meta.db_table
    series_table = MetricSeries._meta.db_table
    rollup_table = MetricRollup._meta.db_table
    MetricSeries.objects.filter(run_id=run_id).delete()
    MetricRollup.objects.filter(run_id=run_id).delete()
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {series_table} (run_id, name, count, first_step, last_step) "
            f"SELECT run_id, name, COUNT(*), MIN(step), MAX(step) FROM {points} "
            f"WHERE run_id = %s GROUP BY run_id, name", [run_value])
        for width in WIDTHS:
            cursor.execute(
                f"INSERT INTO {rollup_table} (run_id, name, width, bucket, vmin, vmax, "
                f"last_step, last_value, last_wall, count) "
                f"SELECT run_id, name, %s, step / %s, MIN(value), MAX(value), MAX(step), 0, 0, "
                f"COUNT(*) FROM {points} WHERE run_id = %s GROUP BY run_id, name, step / %s",
                [width, width, run_value, width])
        for column, source in (("last_value", "value"), ("last_wall", "wall_time")):
            cursor.execute(
                f"UPDATE {rollup_table} SET {column} = (SELECT p.{source} FROM {points} p "
                f"WHERE p.run_id = {rollup_table}.run_id AND p.name = {rollup_table}.name "
                f"AND p.step = {rollup_table}.last_step ORDER BY p.id DESC LIMIT 1) "
                f"WHERE run_id = %s", [run_value])


# Above this many steps a series is never bucketed from its raw points when a rollup width
# can serve the read, even with coarser bucket edges: scanning 100k points per series is
# what made a 100-series read take seconds.
RAW_SCAN_LIMIT = 50_000


def pick_width(span: int, max_points: int, fan_in: int = 8, *,
               prefer_rollups: bool = False) -> int | None:
    """The coarsest width that still gives ``fan_in × max_points`` rollup rows, so a
    returned bucket's edges snap to rollup edges within 1/fan_in of a bucket; for a series
    longer than ``RAW_SCAN_LIMIT`` steps, failing that, the coarsest giving ``max_points``
    rows (edges within one bucket, every bucket still exact in min, max, last and count).
    None when the series is short enough to bucket exactly from its points.
    ``prefer_rollups`` (retention dropped raw points): fan-in 1 at any length."""
    for need in (fan_in, 1) if span > RAW_SCAN_LIMIT or prefer_rollups else (fan_in,):
        best = None
        for width in WIDTHS:
            if span / width >= need * max_points:
                best = width
        if best is not None:
            return best
    return None
