"""Synthesis batches awaiting human spot-checks, their sampled review items, and the
insert-only transition rows that record every state change of both.

A batch's candidate records live in the object store as canonical JSONL (like dataset
versions); a random, seeded sample of them becomes review items. Status changes go through
``apps.review.services`` only.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import models
from django.utils import timezone


class BatchStatus(models.TextChoices):
    PENDING_REVIEW = "pending_review"
    RESAMPLING = "resampling"
    ACCEPTED = "accepted"
    REJECTED = "rejected"


#: The batch state machine: from -> allowed targets. Accepted and rejected are final.
BATCH_TRANSITIONS: dict[str, frozenset[str]] = {
    BatchStatus.PENDING_REVIEW: frozenset({BatchStatus.ACCEPTED, BatchStatus.REJECTED,
                                           BatchStatus.RESAMPLING}),
    BatchStatus.RESAMPLING: frozenset({BatchStatus.ACCEPTED, BatchStatus.REJECTED,
                                       BatchStatus.RESAMPLING}),
    BatchStatus.ACCEPTED: frozenset(),
    BatchStatus.REJECTED: frozenset(),
}
OPEN_BATCH_STATUSES = (BatchStatus.PENDING_REVIEW, BatchStatus.RESAMPLING)


class ItemStatus(models.TextChoices):
    OPEN = "open"
    ACCEPTED = "accepted"
    REJECTED = "rejected"


class Verdict(models.TextChoices):
    ACCEPT = "accept"
    REJECT = "reject"


class Batch(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    dataset = models.ForeignKey("datasets.Dataset", on_delete=models.CASCADE,
                                related_name="batches")
    run = models.ForeignKey("runs.Run", on_delete=models.SET_NULL, null=True, blank=True,
                            related_name="+")
    name = models.CharField(max_length=200, blank=True)
    status = models.CharField(max_length=20, choices=BatchStatus.choices,
                              default=BatchStatus.PENDING_REVIEW)
    #: SHA-256 of the canonical records, as for a dataset version.
    digest = models.CharField(max_length=64)
    uri = models.CharField(max_length=1000)
    trails_uri = models.CharField(max_length=1000, blank=True)
    record_count = models.PositiveIntegerField()
    size_bytes = models.PositiveBigIntegerField()
    schema = models.JSONField(default=dict)
    #: From the engine: generator config, seed, parents, stage statistics, rejection
    #: reasons, distinct-n. Copied into the dataset version's manifest on acceptance.
    manifest = models.JSONField(default=dict)
    #: Dataset versions the records were derived from (resolved from manifest["parents"]).
    parents = models.ManyToManyField("datasets.DatasetVersion", blank=True,
                                     related_name="derived_batches")
    target_error_rate = models.FloatField()
    confidence = models.FloatField()
    sample_seed = models.BigIntegerField()
    sample_size = models.PositiveIntegerField()
    #: The latest acceptance-sampling decision (apps.review.acceptance.Decision).
    decision = models.JSONField(default=dict)
    version = models.ForeignKey("datasets.DatasetVersion", on_delete=models.SET_NULL, null=True,
                                blank=True, related_name="+")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL,
                                   null=True, blank=True, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    decided_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "batches"
        indexes = [models.Index(fields=["team", "created_at"]),
                   models.Index(fields=["dataset", "status"])]

    def __str__(self) -> str:
        return self.name or f"batch {str(self.pk)[:8]}"

    @property
    def is_open(self) -> bool:
        return self.status in OPEN_BATCH_STATUSES


class BatchTransition(models.Model):
    """Insert-only history of a batch's status (Label Studio-style FSM rows)."""

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="transitions")
    from_status = models.CharField(max_length=20, blank=True)
    to_status = models.CharField(max_length=20)
    reason = models.TextField(blank=True)
    data = models.JSONField(default=dict)
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True,
                              blank=True, related_name="+")
    actor_label = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        return f"{self.from_status or '∅'} -> {self.to_status}"


class ReviewItem(models.Model):
    """One sampled record of a batch, judged by one reviewer."""

    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="items")
    #: Position of the record in the batch (0-based).
    index = models.PositiveIntegerField()
    #: The sampling round that drew it (1 = the initial sample, 2+ = resamples).
    round = models.PositiveSmallIntegerField(default=1)
    record = models.JSONField()
    trail = models.JSONField(default=list, blank=True)
    status = models.CharField(max_length=10, choices=ItemStatus.choices,
                              default=ItemStatus.OPEN)
    reason = models.TextField(blank=True)
    reviewed_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL,
                                    null=True, blank=True, related_name="+")
    reviewed_at = models.DateTimeField(null=True, blank=True)
    locked_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL,
                                  null=True, blank=True, related_name="+")
    lock_expires_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["batch", "index"],
                                               name="uniq_review_item_index")]
        indexes = [models.Index(fields=["team", "status"])]

    def __str__(self) -> str:
        return f"{self.batch} #{self.index}"

    def lock_holder(self, now: datetime | None = None) -> Any:
        """The user holding a live lock, or None."""
        now = now or timezone.now()
        if self.locked_by_id and self.lock_expires_at and self.lock_expires_at > now:
            return self.locked_by
        return None


class ReviewTransition(models.Model):
    """Insert-only history of an item's verdict."""

    item = models.ForeignKey(ReviewItem, on_delete=models.CASCADE, related_name="transitions")
    from_status = models.CharField(max_length=10)
    to_status = models.CharField(max_length=10)
    reason = models.TextField(blank=True)
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True,
                              blank=True, related_name="+")
    actor_label = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        return f"{self.from_status} -> {self.to_status}"
