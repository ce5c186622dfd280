"""Set-based storage of one metric batch.

PostgreSQL: two statements per batch, whatever its size. The first claims the batch — inserts
its ``MetricBatch`` row unless ``(run, seq)`` is already there, and only then takes the next
stream position — so a retried batch is detected and spends nothing. The second sends the
batch as four binary arrays and, in one statement, inserts the points, folds them into the
series and rollup tables (``rollups.WIDTHS``) and records the batch's point ids and stream
position. Doing the fold in SQL removed a per-point Python loop and two round trips; binary
arrays cost less to send and parse than a text COPY plus the separate id reservation it needed.

Other databases (SQLite): one multi-row INSERT, and the fold in Python (``rollups.upsert``).
"""

from __future__ import annotations

from typing import Any

import orjson
from django.db import connection
from psycopg import Cursor

from apps.metrics.models import MetricBatch, MetricPoint, MetricRollup, MetricSeries

Row = tuple[str, int, float, float]  # (name, step, value, wall_time)


def insert_points(run_id: object, rows: list[Row]) -> list[int]:
    """Insert ``rows`` for one run inside the caller's transaction (not PostgreSQL's path,
    which is :func:`store_postgres`); returns their ids."""
    created = MetricPoint.objects.bulk_create(
        [MetricPoint(run_id=run_id, name=n, step=s, value=v, wall_time=w) for n, s, v, w in rows],
        batch_size=2000,
    )
    return [p.pk for p in created]


def claim_postgres(run_id: Any, run_table: str, seq: int, count: int) -> tuple[int, int] | None:
    """Insert the batch's row and take its stream position; None when ``(run, seq)`` is
    already stored (or being stored by a concurrent retry, which this waits for). Returns
    (batch row id, stream position). The caller holds the run's row lock."""
    batch = MetricBatch._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"WITH b AS (INSERT INTO {batch} (run_id, seq, stream_seq, first_id, last_id, "
            f"point_count, received_at) VALUES (%s, %s, 0, 0, 0, %s, now()) "
            f"ON CONFLICT (run_id, seq) DO NOTHING RETURNING id), "
            f"s AS (UPDATE {run_table} SET event_seq = event_seq + 1 "
            f"WHERE id = %s AND EXISTS (SELECT 1 FROM b) RETURNING event_seq) "
            f"SELECT b.id, s.event_seq FROM b, s",
            [run_id, seq, count, run_id],
        )
        found = cursor.fetchone()
    return (found[0], found[1]) if found else None


def store_postgres(run_id: Any, batch_id: int, stream_seq: int, widths: tuple[int, ...],
                   names: list[str], steps: list[int], values: list[float],
                   walls: list[float]) -> None:
    """Insert the points and fold them into series and rollups, in one statement (see the
    module docstring). Within a batch the later of two points at one step is a bucket's last,
    as in ``rollups.aggregate``."""
    points = MetricPoint._meta.db_table
    series = MetricSeries._meta.db_table
    rollup = MetricRollup._meta.db_table
    batch = MetricBatch._meta.db_table
    sql = f"""
WITH pts AS (
    SELECT (%(names)s::text[])[k] AS name, step, value, wall, ord
    FROM unnest(%(keys)s::int4[], %(steps)s::int8[], %(values)s::float8[], %(walls)s::float8[])
         WITH ORDINALITY AS p(k, step, value, wall, ord)
),
ins AS (
    INSERT INTO {points} (run_id, name, step, value, wall_time)
    SELECT %(run)s, name, step, value, wall FROM pts ORDER BY ord RETURNING id
),
ser AS (
    INSERT INTO {series} AS t (run_id, name, count, first_step, last_step)
    SELECT %(run)s, name, count(*), min(step), max(step) FROM pts GROUP BY name
    ON CONFLICT (run_id, name) DO UPDATE SET count = t.count + excluded.count,
        first_step = LEAST(t.first_step, excluded.first_step),
        last_step = GREATEST(t.last_step, excluded.last_step)
),
rol AS (
    INSERT INTO {rollup} AS t (run_id, name, width, bucket, vmin, vmax, last_step, last_value,
                               last_wall, count)
    SELECT %(run)s, name, w, step / w, min(value), max(value), max(step),
           (array_agg(value ORDER BY step DESC, ord DESC))[1],
           (array_agg(wall ORDER BY step DESC, ord DESC))[1], count(*)
    FROM pts CROSS JOIN unnest(%(widths)s::int8[]) AS w GROUP BY name, w, step / w
    ON CONFLICT (run_id, name, width, bucket) DO UPDATE SET
        vmin = LEAST(t.vmin, excluded.vmin), vmax = GREATEST(t.vmax, excluded.vmax),
        last_value = CASE WHEN excluded.last_step >= t.last_step
                          THEN excluded.last_value ELSE t.last_value END,
        last_wall = CASE WHEN excluded.last_step >= t.last_step
                         THEN excluded.last_wall ELSE t.last_wall END,
        last_step = GREATEST(t.last_step, excluded.last_step),
        count = t.count + excluded.count
)
UPDATE {batch} SET stream_seq = %(stream)s,
    first_id = (SELECT min(id) FROM ins), last_id = (SELECT max(id) FROM ins)
WHERE id = %(batch)s
"""
    # Names go once each, points refer to them by position (1-based, as SQL arrays are).
    # Each numeric column is one array literal written by orjson ("[1,2.5]" -> "{1,2.5}"):
    # psycopg's list dumper costs ~1 µs an element in Python, orjson ~20 ns, and its
    # shortest round-trip float text is parsed back by PostgreSQL to the same double.
    index: dict[str, int] = {}
    keys = [index.setdefault(n, len(index) + 1) for n in names]
    # A server-binding cursor on Django's own connection (same transaction): parameters are
    # sent apart from the SQL text, not quoted into it.
    with Cursor(connection.connection) as cursor:
        cursor.execute(sql, {"names": list(index), "keys": _array(keys),
                             "steps": _array(steps), "values": _array(values),
                             "walls": _array(walls), "run": run_id, "widths": _array(widths),
                             "stream": stream_seq, "batch": batch_id})


def _array(items: object) -> str:
    """A PostgreSQL array literal of numbers (orjson refuses NaN/inf: validated earlier)."""
    text = orjson.dumps(items).decode()
    return "{" + text[1:-1] + "}"
