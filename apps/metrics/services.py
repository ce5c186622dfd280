"""Metric ingest: validate a batch in one pass, insert it with one statement, once."""

from __future__ import annotations

import logging
import math
import time
from datetime import datetime, timedelta
from typing import Any, NamedTuple, NoReturn

from django.conf import settings
from django.db import IntegrityError, connection, models, transaction
from django.utils import timezone
from pydantic import TypeAdapter

from apps.core import events, signals, telemetry
from apps.core.exceptions import InvalidInput, PayloadTooLarge
from apps.core.protocol import parse_as
from apps.metrics import rollups, writers
from apps.metrics.models import MetricBatch, MetricPoint, MetricSeries
from apps.metrics.sequence import allocate_stream_seq
from apps.metrics.writers import Row, insert_points
from workers import protocol

# Validated with the worker protocol's own type, in one pydantic-core pass over the batch.
_POINTS: TypeAdapter[list[protocol.MetricPoint]] = TypeAdapter(list[protocol.MetricPoint])
_SEQ: TypeAdapter[int] = TypeAdapter(protocol.Seq)
log = logging.getLogger(__name__)


class Columns(NamedTuple):
    """A validated batch as parallel lists, what the PostgreSQL path and the live stream
    both send on."""

    names: list[str]
    steps: list[int]
    values: list[float]
    walls: list[float]


def validate_points(points: Any) -> list[Row]:
    """The batch's rows (name, step, value, wall time), or InvalidInput naming each bad
    ``points[i].field`` (PayloadTooLarge past the size limit, checked before any parsing)."""
    if not isinstance(points, list):
        raise InvalidInput("points must be a list.", details={"points": ["list"]})
    limit = settings.CRUCIBLE["MAX_METRIC_BATCH"]
    if len(points) > limit:
        raise PayloadTooLarge(f"A batch holds at most {limit} points; got {len(points)}. "
                              "Split it into several batches with their own seq.")
    if not points:
        raise InvalidInput("points is empty.", details={"points": ["empty"]})
    now = time.time()
    return [(p["name"], p["step"], float(p["value"]), float(p.get("wall_time", now)))
            for p in parse_as(_POINTS, points, at="points")]


def validate_batch(seq: Any, points: Any = None, columns: Any = None) -> Columns:
    """The batch as columns, from either body shape, or InvalidInput naming the first bad
    field (before any lock)."""
    parse_as(_SEQ, seq, at="seq")
    if columns is not None:
        if points is not None:
            raise InvalidInput("Send a batch's points either as rows (points) or as columns "
                               "(columns), not both.", details={"points": ["both"]})
        return validate_columns(columns)
    return to_columns(validate_points(points))


def to_columns(rows: list[Row]) -> Columns:
    names, steps, values, walls = (list(column) for column in zip(*rows, strict=True))
    return Columns(names, steps, values, walls)


_COLUMN_KEYS = ("name", "step", "value", "wall_time")


def validate_columns(columns: Any) -> Columns:
    """A batch sent as columns — ``{"name": [...], "step": [...], "value": [...],
    "wall_time"?: [...]}``, the i-th point being the i-th of each — checked with the same
    rules as ``protocol.MetricPoint``, a column at a time with C-level builtins (no Python
    loop or object per point), so validation stays a small part of the request. Errors name
    ``columns.<key>[i]``."""
    if not isinstance(columns, dict):
        raise InvalidInput("columns must be an object of arrays: {\"name\": [...], "
                           "\"step\": [...], \"value\": [...], \"wall_time\"?: [...]}.",
                           details={"columns": ["object"]})
    unknown = sorted(set(columns) - set(_COLUMN_KEYS))
    missing = [key for key in _COLUMN_KEYS[:3] if key not in columns]
    if unknown or missing:
        raise InvalidInput(f"columns has {'unknown keys ' + ', '.join(unknown) if unknown else ''}"
                           f"{'; ' if unknown and missing else ''}"
                           f"{'missing keys ' + ', '.join(missing) if missing else ''}; "
                           f"it takes {', '.join(_COLUMN_KEYS)} (wall_time optional).",
                           details={"columns": unknown + missing})
    for key, column in columns.items():
        if not isinstance(column, list):
            raise InvalidInput(f"columns.{key} must be an array.",
                               details={f"columns.{key}": ["array"]})
    names, steps, values = columns["name"], columns["step"], columns["value"]
    n = len(names)
    lengths = {key: len(column) for key, column in columns.items()}
    if len(set(lengths.values())) != 1:
        raise InvalidInput("columns must all be the same length; got "
                           + ", ".join(f"{k}={v}" for k, v in lengths.items()) + ".",
                           details={"columns": ["lengths"]})
    limit = settings.CRUCIBLE["MAX_METRIC_BATCH"]
    if n > limit:
        raise PayloadTooLarge(f"A batch holds at most {limit} points; got {n}. "
                              "Split it into several batches with their own seq.")
    if not n:
        raise InvalidInput("columns are empty.", details={"columns": ["empty"]})
    if set(map(type, names)) != {str}:
        _bad("name", names, lambda x: type(x) is str, "must be a string")
    for name in set(names):
        if not 1 <= len(name) <= protocol.MAX_METRIC_NAME:
            _bad("name", names, lambda x, name=name: x != name,
                 f"must be 1 to {protocol.MAX_METRIC_NAME} characters")
    if set(map(type, steps)) != {int} or min(steps) < 0 or max(steps) > protocol.MAX_STEP:
        _bad("step", steps, lambda x: type(x) is int and 0 <= x <= protocol.MAX_STEP,
             f"must be an integer from 0 to {protocol.MAX_STEP}")
    values = _finite("value", values)
    walls = _finite("wall_time", columns["wall_time"]) if "wall_time" in columns \
        else [time.time()] * n
    return Columns(names, steps, values, walls)


def _finite(key: str, column: list[Any]) -> list[float]:
    """The column as floats, or InvalidInput at its first non-number or non-finite one
    (booleans are not numbers here, as in the protocol's strict types)."""
    types = set(map(type, column))
    try:
        ok = types <= {int, float} and all(map(math.isfinite, column))
    except OverflowError:  # an integer past a double's range (JSON can say 1e400 as digits)
        ok = False
    if not ok:
        _bad(key, column, _is_finite, "must be a finite number")
    return list(map(float, column)) if int in types else column


def _is_finite(x: Any) -> bool:
    try:
        return type(x) in (int, float) and math.isfinite(x)
    except OverflowError:
        return False


def _bad(key: str, column: list[Any], ok: Any, message: str) -> NoReturn:
    index = next((i for i, x in enumerate(column) if not ok(x)), 0)
    raise InvalidInput(f"columns.{key}[{index}]: {message}.",
                       details={f"columns.{key}[{index}]": [message]})


def store_batch(*, run: models.Model, seq: int, rows: list[Row] | None = None,
                columns: Columns | None = None) -> tuple[int, bool]:
    """Store a validated batch of a run whose row the caller holds locked (the runs app's
    ``leased``); returns (points stored, duplicate). A repeated ``seq`` stores nothing.

    The lock gives batches of one run consecutive stream positions, so the live stream can
    be replayed without gaps; a lost race on ``seq`` never spends one (PostgreSQL: the
    position is taken only when the batch row was inserted; SQLite: the savepoint).
    """
    if columns is None:
        assert rows is not None, "store_batch takes rows or columns"
        columns = to_columns(rows)
    count = len(columns.names)
    if connection.vendor == "postgresql":
        stored = _store_postgres(run, seq, columns)
        if stored is None:
            telemetry.count_on_commit(telemetry.METRIC_BATCHES.labels("duplicate"))
            return 0, True
        stream_seq = stored
    else:
        rows = rows or list(zip(*columns, strict=True))
        try:
            with transaction.atomic():
                if MetricBatch.objects.filter(run_id=run.pk, seq=seq).exists():
                    telemetry.count_on_commit(telemetry.METRIC_BATCHES.labels("duplicate"))
                    return 0, True
                stream_seq = allocate_stream_seq(run, 1)
                ids = insert_points(run.pk, rows)
                rollups.upsert(run.pk, rows)
                MetricBatch.objects.create(run_id=run.pk, seq=seq, stream_seq=stream_seq,
                                           first_id=min(ids), last_id=max(ids),
                                           point_count=len(rows))
        except IntegrityError:
            telemetry.count_on_commit(telemetry.METRIC_BATCHES.labels("duplicate"))
            return 0, True  # a concurrent retry of the same batch won
    telemetry.count_on_commit(telemetry.METRIC_BATCHES.labels("stored"))
    telemetry.count_on_commit(telemetry.METRIC_POINTS, count)
    events.publish_on_commit(events.run_group(run.pk), metrics_message(stream_seq, columns))
    _signal_on_commit(run, columns.names)
    return count, False


def store_leased_batch(*, run_model: type[models.Model], run_id: Any, lease: writers.Lease,
                       seq: int, columns: Columns) -> tuple[int, bool] | None:
    """PostgreSQL, outside any transaction: store a validated batch in one autocommitted
    statement that also locks the run and checks its lease (``writers.store_postgres``
    with ``lease``) — no BEGIN, no separate ``SELECT … FOR UPDATE``, no COMMIT round trip.
    Returns (points stored, False), or None when it stored nothing (lease not live, run not
    found or foreign, seq already stored, or a same-seq race lost): the caller then takes
    the locked path, which says which. Every guarantee of :func:`store_batch` holds: the
    statement is the transaction, so readers see all of the batch or none of it."""
    if connection.vendor != "postgresql" or connection.in_atomic_block:
        return None
    try:
        stored = writers.store_postgres(run_id, run_model._meta.db_table, seq,
                                        rollups.WIDTHS, *columns, lease=lease)
    except IntegrityError:  # a retry of this seq committed first (unique (run, seq))
        return None
    if stored is None:
        return None
    stream_seq, team_id = stored
    count = len(columns.names)
    # Committed already (autocommit): these run now.
    telemetry.count_on_commit(telemetry.METRIC_BATCHES.labels("stored"))
    telemetry.count_on_commit(telemetry.METRIC_POINTS, count)
    events.publish_on_commit(events.run_group(run_id), metrics_message(stream_seq, columns))
    names = set(columns.names)
    transaction.on_commit(lambda: _send_stored(run_id, team_id, names))
    return count, False


def _signal_on_commit(run: models.Model, names: list[str]) -> None:
    """Tell the apps above (alerts) which series grew, once the batch is committed."""
    run_id, team_id = run.pk, run.team_id  # type: ignore[attr-defined]
    transaction.on_commit(lambda: _send_stored(run_id, team_id, set(names)))


def _send_stored(run_id: Any, team_id: int, names: set[str]) -> None:
    for _, result in signals.metric_batch_stored.send_robust(
            sender=MetricBatch, run_id=run_id, team_id=team_id, names=names):
        if isinstance(result, Exception):
            log.error("metric_batch_stored receiver failed: %r", result)


def _store_postgres(run: models.Model, seq: int, columns: Columns) -> int | None:
    """One statement (``writers.store_postgres``); the batch's stream position, or None for
    a batch already stored."""
    stored = writers.store_postgres(run.pk, type(run)._meta.db_table, seq, rollups.WIDTHS,
                                    *columns)
    return None if stored is None else stored[0]


# A batch past this many points goes on the channel layer as a summary (its stream position
# and size); a run-stream consumer reads such a batch from the database, only when someone
# watches (``apps.runs.consumers``). Every batch was published whole before: a large batch
# cost each listener's channel a copy of every point, and the writer the encoding of it.
INLINE_POINTS = 256


def metrics_message(stream_seq: int, columns: Columns) -> dict[str, Any]:
    """The live-stream message for one batch: columns, not objects, to keep it small; for
    a batch of more than ``INLINE_POINTS`` points, ``{"type": "metrics", "seq", "count"}``
    without the points (``summary``)."""
    if len(columns.names) > INLINE_POINTS:
        return {"type": "metrics", "seq": stream_seq, "count": len(columns.names),
                "summary": True}
    return {"type": "metrics", "seq": stream_seq, "names": columns.names,
            "steps": columns.steps, "values": columns.values, "walls": columns.walls}


def prune_raw_points(*, now: datetime | None = None) -> dict[str, int]:
    """Drop the raw points of every team with ``metric_retention_days`` set whose batches
    were ingested longer ago than that; series and rollups stay, so charts read the same
    above rollup resolution. Marks the touched series ``pruned`` (reads then prefer rollups)
    in the same transaction. Returns {team slug: points dropped}."""
    from apps.teams.models import Team  # the metrics app sits below teams otherwise

    now = now or timezone.now()
    dropped: dict[str, int] = {}
    points = MetricPoint._meta.db_table
    for team in Team.objects.filter(metric_retention_days__isnull=False):
        cutoff = now - timedelta(days=team.metric_retention_days or 0)
        old = MetricBatch.objects.filter(run__team=team, received_at__lt=cutoff,
                                         pruned_at__isnull=True)
        with transaction.atomic():
            run_ids = list(old.values_list("run_id", flat=True).distinct())
            if not run_ids:
                continue
            # Points are found by their batch's id range: the ingest time is the batch's.
            sql, params = old.values("run_id", "first_id", "last_id").query.sql_with_params()
            with connection.cursor() as cursor:
                if connection.vendor == "postgresql":  # driven from the batches: id ranges
                    cursor.execute(
                        f"DELETE FROM {points} p USING ({sql}) b WHERE p.run_id = b.run_id "
                        f"AND p.id BETWEEN b.first_id AND b.last_id", params)
                else:
                    cursor.execute(
                        f"DELETE FROM {points} WHERE EXISTS (SELECT 1 FROM ({sql}) b "
                        f"WHERE b.run_id = {points}.run_id "
                        f"AND {points}.id BETWEEN b.first_id AND b.last_id)", params)
                dropped[team.slug] = cursor.rowcount
            # The batch rows stay: they are what makes a retried seq a no-op.
            old.update(pruned_at=now)
            MetricSeries.objects.filter(run_id__in=run_ids).update(pruned=True)
    return dropped
