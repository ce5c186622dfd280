from __future__ import annotations

import json
from typing import Any

from django.db.models import QuerySet

from apps.core.exceptions import NotFound
from apps.core.storage import store
from apps.runs.models import Run


def runs_with_relations(queryset: QuerySet[Run]) -> QuerySet[Run]:
    return queryset.select_related(
        "project", "environment_version__environment"
    ).prefetch_related("pins__dataset_version__dataset")


def report(run: Run) -> dict[str, Any]:
    if not run.report_uri:
        raise NotFound(f"Run {run.pk} has no report (yet).")
    return json.loads(store().get_bytes(run.report_uri))


def worker_view(run: Run) -> dict[str, Any]:
    """What a worker needs to execute a run: the frozen document plus object URIs."""
    ev = run.environment_version
    return {
        "id": str(run.pk),
        "team": run.team.slug,
        "project": run.project.slug,
        "kind": run.kind,
        "status": run.status,
        "pool": run.pool,
        "attempt": run.attempt,
        "config": run.config,
        "lease_id": run.lease_id,
        "lease_expires_at": run.lease_expires_at.isoformat() if run.lease_expires_at else None,
        "datasets": {
            pin.alias: {
                "dataset": pin.dataset_version.dataset.slug,
                "digest": pin.dataset_version.digest,
                "number": pin.dataset_version.number,
                "uri": pin.dataset_version.uri,
                "record_count": pin.dataset_version.record_count,
            }
            for pin in run.pins.select_related("dataset_version__dataset")
        },
        "environment": (
            {"environment": ev.environment.slug, "digest": ev.digest, "spec": ev.spec}
            if ev else None
        ),
        "checkpoints": [
            {"step": c.step, "uri": c.uri} for c in run.checkpoints.order_by("step")
        ],
    }
