"""Metric ingest: validate a batch in one pass, insert it with one statement, once."""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings
from django.db import IntegrityError, connection, models, transaction
from pydantic import TypeAdapter

from apps.core import events, telemetry
from apps.core.exceptions import InvalidInput, PayloadTooLarge
from apps.core.protocol import parse_as
from apps.metrics import rollups, writers
from apps.metrics.models import MetricBatch
from apps.metrics.sequence import allocate_stream_seq
from apps.metrics.writers import Row, insert_points
from workers import protocol

# Validated with the worker protocol's own type, in one pydantic-core pass over the batch.
_POINTS: TypeAdapter[list[protocol.MetricPoint]] = TypeAdapter(list[protocol.MetricPoint])
_SEQ: TypeAdapter[int] = TypeAdapter(protocol.Seq)


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


def validate_batch(seq: Any, points: Any) -> list[Row]:
    """The batch's rows, or InvalidInput naming the first bad field (before any lock)."""
    parse_as(_SEQ, seq, at="seq")
    return validate_points(points)


def store_batch(*, run: models.Model, seq: int, rows: list[Row]) -> tuple[int, bool]:
    """Store a validated batch of a run whose row the caller holds locked (the runs app's
    ``leased``); returns (points stored, duplicate). A repeated ``seq`` stores nothing.

    The lock gives batches of one run consecutive stream positions, so the live stream can
    be replayed without gaps; a lost race on ``seq`` never spends one (PostgreSQL: the
    position is taken only when the batch row was inserted; SQLite: the savepoint).
    """
    if connection.vendor == "postgresql":
        stored = _store_postgres(run, seq, rows)
        if stored is None:
            telemetry.count_on_commit(telemetry.METRIC_BATCHES.labels("duplicate"))
            return 0, True
        stream_seq = stored
    else:
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
    telemetry.count_on_commit(telemetry.METRIC_POINTS, len(rows))
    events.publish_on_commit(events.run_group(run.pk), metrics_message(stream_seq, rows))
    return len(rows), False


def _store_postgres(run: models.Model, seq: int, rows: list[Row]) -> int | None:
    """Two statements (``writers.claim_postgres``, ``writers.store_postgres``); the batch's
    stream position, or None for a batch already stored."""
    claimed = writers.claim_postgres(run.pk, type(run)._meta.db_table, seq, len(rows))
    if claimed is None:
        return None
    batch_id, stream_seq = claimed
    names, steps, values, walls = (list(column) for column in zip(*rows, strict=True))
    writers.store_postgres(run.pk, batch_id, stream_seq, rollups.WIDTHS, names, steps, values,
                           walls)
    return stream_seq


def metrics_message(stream_seq: int, rows: list[Row]) -> dict[str, Any]:
    """The live-stream message for one batch: columns, not objects, to keep it small."""
    return {
        "type": "metrics",
        "seq": stream_seq,
        "names": [r[0] for r in rows],
        "steps": [r[1] for r in rows],
        "values": [r[2] for r in rows],
        "walls": [r[3] for r in rows],
    }
