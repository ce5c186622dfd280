"""Metric ingest: validate a batch in one pass, insert it with one statement, once."""

from __future__ import annotations

import math
import time
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction

from apps.core import events
from apps.core.exceptions import InvalidInput, PayloadTooLarge
from apps.metrics.models import MetricBatch, MetricPoint
from apps.runs.models import Run
from apps.runs.services import check_lease

MAX_NAME = 200


def validate_points(points: Any) -> list[tuple[str, int, float, float]]:
    """Hand-rolled rather than a DRF serializer: at 10k points a batch, per-field serializer
    objects cost ~50x more than this loop."""
    if not isinstance(points, list):
        raise InvalidInput("points must be a list.", details={"points": ["list"]})
    limit = settings.CRUCIBLE["MAX_METRIC_BATCH"]
    if len(points) > limit:
        raise PayloadTooLarge(f"A batch holds at most {limit} points; got {len(points)}. "
                              "Split it into several batches with their own seq.")
    if not points:
        raise InvalidInput("points is empty.", details={"points": ["empty"]})
    now = time.time()
    rows = []
    for i, p in enumerate(points):
        if not isinstance(p, dict):
            raise InvalidInput(f"points[{i}] must be an object.")
        name, step, value = p.get("name"), p.get("step"), p.get("value")
        wall = p.get("wall_time", now)
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise InvalidInput(f"points[{i}].name must be a string of 1-{MAX_NAME} characters.",
                               details={f"points[{i}].name": [repr(name)[:50]]})
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InvalidInput(f"points[{i}].step must be an integer >= 0.",
                               details={f"points[{i}].step": [repr(step)[:50]]})
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if not numeric or not math.isfinite(value):
            raise InvalidInput(f"points[{i}].value must be a finite number.",
                               details={f"points[{i}].value": [repr(value)[:50]]})
        if not isinstance(wall, int | float) or isinstance(wall, bool) or not math.isfinite(wall):
            raise InvalidInput(f"points[{i}].wall_time must be a unix time in seconds.")
        rows.append((name, step, float(value), float(wall)))
    return rows


def ingest_batch(*, run: Run, lease_id: str, seq: int, points: Any) -> tuple[int, bool]:
    """Store a batch; returns (points stored, duplicate). A repeated ``seq`` stores nothing."""
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise InvalidInput("seq must be an integer >= 0.", details={"seq": [repr(seq)[:50]]})
    rows = validate_points(points)
    if MetricBatch.objects.filter(run=run, seq=seq).exists():
        return 0, True
    try:
        with transaction.atomic():
            run = Run.objects.get(pk=run.pk)
            check_lease(run, lease_id)
            MetricBatch.objects.create(run=run, seq=seq, point_count=len(rows))
            MetricPoint.objects.bulk_create(
                [MetricPoint(run_id=run.pk, name=n, step=s, value=v, wall_time=w)
                 for n, s, v, w in rows],
                batch_size=2000,
            )
    except IntegrityError:
        return 0, True  # a concurrent retry of the same batch won
    latest: dict[str, tuple[int, float]] = {}
    for name, step, value, _ in rows:
        if name not in latest or step >= latest[name][0]:
            latest[name] = (step, value)
    events.publish_on_commit(events.run_group(run.pk), {
        "type": "metrics", "seq": seq, "count": len(rows),
        "latest": {n: {"step": s, "value": v} for n, (s, v) in latest.items()},
    })
    return len(rows), False
