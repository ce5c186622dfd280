"""Metric reads. Each series is cut into at most N equal step ranges and each range
returns its min, max, last value, count and wall time. Small series are bucketed from their
points in the database. (Bucket numbers are computed in double precision: NUMERIC
arithmetic made the grouping 3x slower, and 64-bit integer products overflow for huge step
ranges. FLOOR matters: PostgreSQL's cast to BIGINT rounds.) Large ones are merged from the
rollups written at ingest (see ``rollups``): a chart of a million-point series reads ~16k
rollup rows, not a million points, as whole columns (one binary array per column) that
numpy merges, so no Python object is made per row.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import psycopg
from django.db import connection
from psycopg.abc import Buffer
from psycopg.adapt import Loader
from psycopg.pq import Format

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


# The rollup rows a read merges, in bucket order per series: on PostgreSQL every series of a
# request in one statement, each column of a series as one array fetched in binary and read
# by numpy in place (building a Python tuple per rollup row is what made a 100-series read
# cost a second); elsewhere a query per series.
# (An index-only scan there: migration 0006 makes the unique index cover these columns.)
_ROLLUP_ARRAYS_PG = """
SELECT q.i, r.*
FROM unnest(%(names)s::text[], %(widths)s::int4[]) WITH ORDINALITY AS q(name, width, i)
CROSS JOIN LATERAL (
    SELECT array_agg(last_step), array_agg(vmin), array_agg(vmax), array_agg(last_value),
           array_agg(count), array_agg(last_wall)
    FROM (SELECT last_step, vmin, vmax, last_value, count, last_wall FROM {table}
          WHERE run_id = %(run)s AND name = q.name AND width = q.width
          ORDER BY bucket) ordered
) r
"""
_ROLLUP_ONE = ("SELECT last_step, vmin, vmax, last_value, count, last_wall FROM {table} "
               "WHERE run_id = %s AND name = %s AND width = %s ORDER BY bucket")
# The rollup rows a merge takes, as columns: the series' place in the request (from 1),
# then each row's last step, min, max, last value, count and last wall time.
ROW_FIELDS = (("i", "i8"), ("step", "i8"), ("min", "f8"), ("max", "f8"), ("last", "f8"),
              ("count", "i8"), ("wall", "f8"))
Rows = dict[str, np.ndarray]


def _from_binary_array(data: Buffer | None, kind: str) -> np.ndarray:
    """A one-dimensional array without NULLs in PostgreSQL's binary format (a 12-byte
    header, then a 8-byte dimension, then each element as a 4-byte length and its
    big-endian value) as a native numpy array (a copy: ``data`` may be reused after).
    Hand-written: psycopg's own array loader makes a Python number of every element, the
    cost this avoids."""
    if data is None:
        return np.empty(0, dtype=kind)
    head = bytes(data[:20])
    ndim = int.from_bytes(head[:4], "big")
    if ndim == 0:
        return np.empty(0, dtype=kind)
    if ndim != 1 or int.from_bytes(head[4:8], "big") != 0:
        raise ValueError("expected a one-dimensional array without NULLs")
    size = int.from_bytes(head[12:16], "big")
    elements = np.frombuffer(data, dtype=np.dtype([("len", ">i4"), ("v", ">" + kind)]),
                             count=size, offset=20)
    if np.any(elements["len"] != 8):
        raise ValueError("unexpected element size in a binary array")
    return elements["v"].astype(kind)


class _Int8Array(Loader):
    """A binary int8[] straight into numpy (see :func:`_from_binary_array`)."""

    format = Format.BINARY
    kind = "i8"

    def load(self, data: Buffer) -> np.ndarray:
        return _from_binary_array(data, self.kind)


class _Float8Array(_Int8Array):
    kind = "f8"


_ARRAY_LOADERS = ((1016, _Int8Array), (1022, _Float8Array))  # int8[], float8[] type oids


def metric_names(run_id: object) -> list[str]:
    return list(
        MetricSeries.objects.filter(run_id=run_id).values_list("name", flat=True)
        .order_by("name")
    )


def run_series(run_id: object) -> dict[str, MetricSeries]:
    """Every series of a run by name, in name order: its names and what a read of any of
    them needs, in one query (pass to :func:`series_columns` as ``infos``)."""
    return {s.name: s for s in MetricSeries.objects.filter(run_id=run_id).order_by("name")}


def series(run_id: object, name: str, *, max_points: int) -> list[dict[str, Any]]:
    """``[{"step", "min", "max", "last", "count", "wall"}]`` with at most ``max_points``
    rows; the step and wall time (unix seconds) of a bucket are those of its last point."""
    return series_many(run_id, [name], max_points=max_points)[name]


def series_many(run_id: object, names: list[str], *, max_points: int
                ) -> dict[str, list[dict[str, Any]]]:
    """:func:`series` of several metrics of a run."""
    return {name: as_points(columns) for name, columns
            in series_columns(run_id, names, max_points=max_points).items()}


def series_columns(run_id: object, names: list[str], *, max_points: int,
                   infos: dict[str, MetricSeries] | None = None) -> dict[str, dict[str, Any]]:
    """:func:`series_many` as parallel columns (``COLUMNS``; numpy arrays or lists, both
    rendered as JSON arrays by ``FastJSONRenderer``). Series large enough to read from
    rollups are read together (one statement on PostgreSQL: 100 series of 100k points each
    merge ~160k rollup rows, not 10M points); small ones point by point; the rest bucketed
    from points. ``infos``: the run's series from :func:`run_series`, if already read."""
    run_param = run_id.hex if connection.vendor == "sqlite" else run_id  # type: ignore[attr-defined]
    if infos is None:
        infos = {s.name: s for s in MetricSeries.objects.filter(run_id=run_id,
                                                                name__in=names)}
    out: dict[str, dict[str, Any]] = {}
    from_rollups: list[tuple[str, int, int, int]] = []  # (name, width, lo, hi)
    for name in names:
        info = infos.get(name)
        if info is not None and info.count <= max_points and not info.pruned:
            out[name] = as_columns(_every_point(run_id, name))
            continue
        width = None if info is None else pick_width(info.last_step - info.first_step + 1,
                                                     max_points, prefer_rollups=info.pruned)
        if width is None or info is None:
            out[name] = as_columns(_from_points(run_param, name, max_points))
        else:
            from_rollups.append((name, width, info.first_step, info.last_step))
    if from_rollups:
        rows = _rollup_rows(run_param, [(name, width) for name, width, *_ in from_rollups])
        merged = merge_rollups(rows, [(lo, hi) for *_, lo, hi in from_rollups], max_points)
        out.update(zip([name for name, *_ in from_rollups], merged, strict=True))
    return {name: out[name] for name in names}


def _from_points(run_param: object, name: str, max_points: int) -> list[dict[str, Any]]:
    with connection.cursor() as cursor:
        cursor.execute(_DOWNSAMPLE_SQL.format(table=MetricPoint._meta.db_table),
                       {"run": run_param, "name": name, "n": max_points})
        return [{"step": step, "min": vmin, "max": vmax, "last": last, "count": count,
                 "wall": wall} for step, vmin, vmax, last, count, wall in cursor.fetchall()]


def _rollup_rows(run_param: object, requests: list[tuple[str, int]]) -> Rows:
    """The rollup rows of each (name, width), ordered by series then step."""
    table = MetricRollup._meta.db_table
    names = [name for name, _ in ROW_FIELDS]
    if connection.vendor == "postgresql":
        connection.ensure_connection()
        raw = psycopg.Cursor(connection.connection)  # server-side binding: binary results
        raw.format = Format.BINARY
        for oid, loader in _ARRAY_LOADERS:
            raw.adapters.register_loader(oid, loader)
        # Wrapped as Django wraps its own cursors: errors translated, queries logged/counted.
        dbapi = cast(Any, raw)  # the stubs type the argument as Django's own wrapper
        cursor = (connection.make_debug_cursor(dbapi) if connection.queries_logged
                  else connection.make_cursor(dbapi))
        with cursor:
            cursor.execute(_ROLLUP_ARRAYS_PG.format(table=table),
                           {"run": run_param, "names": [name for name, _ in requests],
                            "widths": [width for _, width in requests]})
            fetched = cursor.fetchall()
        parts = [[_from_binary_array(None, kind) if a is None else a
                  for a, (_, kind) in zip(arrays, ROW_FIELDS[1:], strict=True)]
                 for _, *arrays in fetched]
        rows = {name: np.concatenate([part[k] for part in parts]) if parts
                else np.empty(0, dtype=kind)
                for k, (name, kind) in enumerate(ROW_FIELDS[1:])}
        rows["i"] = np.repeat(np.array([i for i, *_ in fetched], dtype=np.int64),
                              [len(part[0]) for part in parts]).astype(np.int64)
    else:
        fetched = []
        with connection.cursor() as cursor:
            for i, (name, width) in enumerate(requests, start=1):
                cursor.execute(_ROLLUP_ONE.format(table=table), [run_param, name, width])
                fetched += [(i, *row) for row in cursor.fetchall()]
        rows = {name: np.array([row[k] for row in fetched], dtype=kind)
                for k, (name, kind) in enumerate(ROW_FIELDS)}
    # The statements ask for this order; the merge relies on it, so it is checked (cheap)
    # rather than assumed of a plan, and restored if a plan ever returned another.
    if len(rows["i"]) > 1:
        di, ds = np.diff(rows["i"]), np.diff(rows["step"])
        if not np.all((di > 0) | ((di == 0) & (ds > 0))):
            order = np.lexsort((rows["step"], rows["i"]))
            rows = {name: rows[name][order] for name in names}
    return rows


def merge_rollups(rows: Rows, bounds: list[tuple[int, int]], max_points: int
                  ) -> list[dict[str, np.ndarray]]:
    """Group each series' rollup rows (``ROW_FIELDS`` columns, ordered by series ``i``
    (1-based) then step) into at most ``max_points`` equal step ranges of its ``(lo, hi)``:
    a row belongs to the range holding its last step (computed in double precision, as the
    point-level SQL does). A range keeps the min, max, summed count, and the step, value
    and wall time of its last row. One set of columns per series, in the order of
    ``bounds``."""
    series_index = rows["i"] - 1
    if not len(series_index):
        return [{key: np.empty(0, dtype=kind) for key, kind in ROW_FIELDS[1:]}
                for _ in bounds]
    lo = np.array([b[0] for b in bounds], dtype=np.int64)[series_index]
    # The span in Python integers: hi - lo + 1 can be 2**63, past int64.
    span = np.array([float(hi - lo + 1) for lo, hi in bounds], dtype=np.float64)
    steps = rows["step"]
    # Steps are never negative, so step - lo fits in int64; the cap keeps float rounding at
    # the top of a huge span from opening a range past the last.
    group = np.minimum(np.floor((steps - lo).astype(np.float64) * max_points
                                / span[series_index]), max_points - 1).astype(np.int64)
    first = np.ones(len(steps), dtype=bool)
    first[1:] = (series_index[1:] != series_index[:-1]) | (group[1:] != group[:-1])
    starts = np.flatnonzero(first)
    ends = np.append(starts[1:], len(steps)) - 1
    vmin = np.minimum.reduceat(rows["min"], starts)
    vmax = np.maximum.reduceat(rows["max"], starts)
    count = np.add.reduceat(rows["count"], starts)
    step, last, wall = steps[ends], rows["last"][ends], rows["wall"][ends]
    cuts = np.searchsorted(series_index[starts], np.arange(len(bounds) + 1))
    return [{"step": step[a:b], "min": vmin[a:b], "max": vmax[a:b], "last": last[a:b],
             "count": count[a:b], "wall": wall[a:b]} for a, b in zip(cuts[:-1], cuts[1:],
                                                                      strict=True)]


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


def as_points(columns: dict[str, Any]) -> list[dict[str, Any]]:
    """Parallel columns (lists or numpy arrays) back into one dict per bucket, with plain
    Python numbers."""
    lists = [c.tolist() if isinstance(c, np.ndarray) else c for c in
             (columns[key] for key in COLUMNS)]
    return [dict(zip(COLUMNS, row, strict=True)) for row in zip(*lists, strict=True)]


def points_after(run_id: object, name: str, *, after_step: int, limit: int
                 ) -> tuple[list[dict[str, Any]], bool]:
    """The raw points of a series after ``after_step``, oldest first, at most ``limit`` (in the
    downsampled shape, each its own bucket), and whether more follow: a polling client asks
    again with the last step it got, reading only the index range it has not seen."""
    rows = list(MetricPoint.objects.filter(run_id=run_id, name=name, step__gt=after_step)
                .order_by("step", "id").values_list("step", "value")[: limit + 1])
    return ([{"step": step, "min": value, "max": value, "last": value, "count": 1}
             for step, value in rows[:limit]], len(rows) > limit)
