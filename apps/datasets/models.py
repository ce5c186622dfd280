"""Datasets and their immutable, content-addressed versions."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class Dataset(models.Model):
    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="datasets")
    project = models.ForeignKey(
        "projects.Project", on_delete=models.CASCADE, related_name="datasets"
    )
    slug = models.SlugField(max_length=64)
    description = models.TextField(blank=True)
    current_version = models.ForeignKey(
        "DatasetVersion", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "slug"], name="uniq_dataset_slug")]

    def __str__(self) -> str:
        return self.slug


class DatasetVersion(models.Model):
    """Records live in the object store as canonical JSONL; ``digest`` is their SHA-256.

    Rows are never updated: a change of content is a new version (enforced by a database
    trigger, see migration 0002).
    """

    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    dataset = models.ForeignKey(Dataset, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    digest = models.CharField(max_length=64, db_index=True)
    uri = models.CharField(max_length=1000)
    record_count = models.PositiveBigIntegerField()
    size_bytes = models.PositiveBigIntegerField()
    schema = models.JSONField(default=dict)
    message = models.CharField(max_length=500, blank=True)
    #: How the records were made (generator config, seed, parents, stage statistics), for
    #: versions that come from an accepted synthesis batch; empty for plain uploads.
    manifest = models.JSONField(default=dict, blank=True)
    parents = models.ManyToManyField("self", symmetrical=False, related_name="children",
                                     blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["dataset", "digest"], name="uniq_version_digest"),
            models.UniqueConstraint(fields=["dataset", "number"], name="uniq_version_number"),
        ]

    def __str__(self) -> str:
        return f"{self.dataset_id}@v{self.number}"
