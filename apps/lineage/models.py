"""Edges between artifacts: dataset version → run → checkpoint → eval run, and so on.

Written by services only (no API writes); insert-only.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class ArtifactType(models.TextChoices):
    DATASET_VERSION = "dataset_version"
    ENVIRONMENT_VERSION = "environment_version"
    RUN = "run"
    CHECKPOINT = "checkpoint"
    REPORT = "report"  # a run's report (eval scores, profile), keyed by the run's id
    SERVED_VARIANT = "served_variant"  # a served model derived from a checkpoint (evals)


class LineageEdge(models.Model):
    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    source_type = models.CharField(max_length=32, choices=ArtifactType.choices)
    source_id = models.CharField(max_length=100)
    target_type = models.CharField(max_length=32, choices=ArtifactType.choices)
    target_id = models.CharField(max_length=100)
    relation = models.CharField(max_length=32)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["team", "source_type", "source_id", "target_type", "target_id",
                        "relation"],
                name="uniq_lineage_edge",
            )
        ]
        indexes = [
            models.Index(fields=["team", "source_type", "source_id"]),
            models.Index(fields=["team", "target_type", "target_id"]),
        ]

    def __str__(self) -> str:
        source = f"{self.source_type}:{self.source_id}"
        return f"{source} -{self.relation}-> {self.target_type}:{self.target_id}"
