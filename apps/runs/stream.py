"""Reads behind the live run stream: everything at stream positions after ``after``.

Events (status changes included) and metric batches share one per-run sequence. A replay
returns only a contiguous run of positions: a position whose transaction has not
committed yet is a hole, and sending past it would make the client skip it later.
"""

from __future__ import annotations

from typing import Any

from apps.metrics.models import MetricBatch, MetricPoint
from apps.runs.models import RunEvent

MAX_MESSAGES = 500


def event_message(event: RunEvent) -> dict[str, Any]:
    return {
        "type": "event",
        "seq": event.seq,
        "level": event.level,
        "kind": event.kind,
        "message": event.message,
        "data": event.data,
        "created_at": event.created_at.isoformat(),
    }


def batch_message(run_id: object, batch: MetricBatch) -> dict[str, Any]:
    points = MetricPoint.objects.filter(
        run_id=run_id, id__gte=batch.first_id, id__lte=batch.last_id
    ).order_by("id").values_list("name", "step", "value", "wall_time")
    names, steps, values, walls = [], [], [], []
    for name, step, value, wall in points:
        names.append(name)
        steps.append(step)
        values.append(value)
        walls.append(wall)
    return {"type": "metrics", "seq": batch.stream_seq, "names": names, "steps": steps,
            "values": values, "walls": walls}


def messages_after(run_id: object, after: int, limit: int = MAX_MESSAGES) -> list[dict[str, Any]]:
    """Messages at positions after+1, after+2, … up to the first hole (at most ``limit``)."""
    upper = after + limit
    found: dict[int, Any] = {}
    for event in RunEvent.objects.filter(run_id=run_id, seq__gt=after, seq__lte=upper):
        found[event.seq] = event
    for batch in MetricBatch.objects.filter(run_id=run_id, stream_seq__gt=after,
                                            stream_seq__lte=upper):
        found[batch.stream_seq] = batch
    out = []
    position = after + 1
    while position in found:
        item = found[position]
        out.append(event_message(item) if isinstance(item, RunEvent)
                   else batch_message(run_id, item))
        position += 1
    return out
