"""Environments (tasks with verifiable rewards) and their content-addressed versions."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class QcStatus(models.TextChoices):
    PENDING = "pending"
    PASSED = "passed"
    FAILED = "failed"


class Environment(models.Model):
    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="environments")
    project = models.ForeignKey(
        "projects.Project", on_delete=models.CASCADE, related_name="environments"
    )
    slug = models.SlugField(max_length=64)
    description = models.TextField(blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "slug"], name="uniq_env_slug")]

    def __str__(self) -> str:
        return self.slug


class EnvironmentVersion(models.Model):
    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    environment = models.ForeignKey(Environment, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    digest = models.CharField(max_length=64, db_index=True)
    spec = models.JSONField()
    qc_status = models.CharField(max_length=16, choices=QcStatus.choices,
                                 default=QcStatus.PENDING)
    qc_report = models.JSONField(default=dict, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["environment", "digest"], name="uniq_env_digest"),
            models.UniqueConstraint(fields=["environment", "number"], name="uniq_env_number"),
        ]

    def __str__(self) -> str:
        return f"{self.environment_id}@v{self.number}"
