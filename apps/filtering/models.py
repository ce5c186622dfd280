from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from workers.filtering import Mode


class Surface(models.TextChoices):
    SAMPLES = "samples", "Stored samples"
    SERVE = "serve", "Served completions"
    EXPORT = "export", "Dataset exports"


MODE_CHOICES = [(m.value, m.value) for m in Mode]


class FilterPolicy(models.Model):
    """One team's mode per surface. A team without a row filters nothing (every surface
    ``off``): turning filtering on is an admin's decision, and no stored data changes
    meaning under a team that never chose."""

    team = models.OneToOneField("teams.Team", on_delete=models.CASCADE, related_name="+")
    samples = models.CharField(max_length=8, choices=MODE_CHOICES, default=Mode.OFF.value)
    serve = models.CharField(max_length=8, choices=MODE_CHOICES, default=Mode.OFF.value)
    export = models.CharField(max_length=8, choices=MODE_CHOICES, default=Mode.OFF.value)
    updated_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL,
                                   null=True, blank=True, related_name="+")
    updated_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.team_id}: samples={self.samples} serve={self.serve} export={self.export}"


class Finding(models.Model):
    """What the filter found in one object (a sample, a dataset export, …) and what it did:
    kinds only, never the matched text, so this log leaks nothing itself."""

    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    surface = models.CharField(max_length=8, choices=Surface.choices)
    action = models.CharField(max_length=8, choices=MODE_CHOICES)
    target_type = models.CharField(max_length=32)  # sample | dataset-version | run
    target_id = models.CharField(max_length=64)
    kinds = models.JSONField(default=list)
    count = models.PositiveIntegerField(default=1)  # items affected (records of an export)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["team", "target_type", "target_id"]),
                   models.Index(fields=["team", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.surface}:{self.action} {self.target_type}/{self.target_id} {self.kinds}"
