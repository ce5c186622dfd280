"""Code executions requested through the API and run by the ``sandbox`` pool."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone


class ExecutionStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"  # the sandbox ran; the verdict (OK, TLE, CE, …) is in the result
    ERROR = "error"  # the platform failed to run it (worker lost, engine crash)


ACTIVE = (ExecutionStatus.QUEUED, ExecutionStatus.RUNNING)


class Execution(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    batch = models.UUIDField(null=True, blank=True, db_index=True)
    language = models.CharField(max_length=20)
    request = models.JSONField()
    status = models.CharField(max_length=10, choices=ExecutionStatus.choices,
                              default=ExecutionStatus.QUEUED)
    result = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True)
    worker = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    # Set by start: the result is accepted only under this lease, from the token holding it.
    lease_id = models.CharField(max_length=64, blank=True)
    lease_holder = models.CharField(max_length=16, blank=True)  # the worker token's prefix

    class Meta:
        indexes = [
            models.Index(fields=["team", "status"]),
            models.Index(fields=["team", "created_at"]),
        ]

    def __str__(self) -> str:
        return f"{self.language} {self.id} ({self.status})"


class SandboxSession(models.Model):
    """A team's sandbox session: the record and audit anchor. The workspace itself lives on a
    session host (workers/sandbox/session_host.py) under ``engine_id``."""

    OPEN, CLOSED = "open", "closed"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    engine_id = models.CharField(max_length=64)
    state = models.CharField(max_length=10, default=OPEN,
                             choices=[(OPEN, "open"), (CLOSED, "closed")])
    limits = models.JSONField()
    # the session's EgressPolicy (allow-listed outbound HTTP(S) through the engine's proxy);
    # null: no network at all
    egress = models.JSONField(null=True, blank=True)
    forked_from = models.ForeignKey("sandbox.SandboxSnapshot", on_delete=models.SET_NULL,
                                    null=True, blank=True, related_name="forks")
    closed_reason = models.CharField(max_length=200, blank=True)
    execs = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["team", "state"])]

    def __str__(self) -> str:
        return f"session {self.id} ({self.state})"


class SandboxSnapshot(models.Model):
    """A snapshot of a session's workspace; forks and restores name it by this id."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    session = models.ForeignKey(SandboxSession, on_delete=models.CASCADE,
                                related_name="snapshots")
    engine_id = models.CharField(max_length=64)
    bytes = models.BigIntegerField(default=0)
    dropped = models.BooleanField(default=False)
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"snapshot {self.id}"
