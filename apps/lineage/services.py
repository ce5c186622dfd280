from __future__ import annotations

from django.db.models import Model

from apps.lineage.models import ArtifactType, LineageEdge

_TYPES = {
    "datasets.datasetversion": ArtifactType.DATASET_VERSION,
    "environments.environmentversion": ArtifactType.ENVIRONMENT_VERSION,
    "runs.run": ArtifactType.RUN,
    "runs.checkpoint": ArtifactType.CHECKPOINT,
    "evals.servedvariant": ArtifactType.SERVED_VARIANT,
}


def artifact_key(obj: Model) -> tuple[str, str]:
    kind = _TYPES[obj._meta.label_lower]
    if kind in (ArtifactType.DATASET_VERSION, ArtifactType.ENVIRONMENT_VERSION):
        return kind, obj.digest  # type: ignore[attr-defined]
    return kind, str(obj.pk)


def edge_create(
    *, team_id: int, source: Model | tuple[str, str], target: Model | tuple[str, str],
    relation: str,
) -> LineageEdge:
    """Called inside the caller's transaction; repeating an edge is a no-op. An end is a
    model instance or a ``(type, id)`` key for artifacts without a row of their own."""
    source_type, source_id = source if isinstance(source, tuple) else artifact_key(source)
    target_type, target_id = target if isinstance(target, tuple) else artifact_key(target)
    # Content-addressed ids repeat across teams (same records, same digest): the team is
    # part of an edge's identity.
    edge, _ = LineageEdge.objects.get_or_create(
        team_id=team_id, source_type=source_type, source_id=source_id,
        target_type=target_type, target_id=target_id, relation=relation,
    )
    return edge
