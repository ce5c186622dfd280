"""Runs and what they produce: events, checkpoints, samples, artifacts.

A run's config and pinned versions are frozen at creation; events, checkpoints and
samples are append-only. Status changes go through ``apps.runs.services`` only.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone


class RunKind(models.TextChoices):
    TRAIN = "train"
    EVAL = "eval"
    SYNTHESIZE = "synthesize"
    QC = "qc"
    PROFILE = "profile"


class RunStatus(models.TextChoices):
    QUEUED = "queued"
    CLAIMED = "claimed"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"
    PREEMPTED = "preempted"


class Pool(models.TextChoices):
    GPU = "gpu"
    SANDBOX = "sandbox"
    CPU = "cpu"


ACTIVE_STATUSES = (RunStatus.CLAIMED, RunStatus.RUNNING)
FINAL_STATUSES = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELED)


class Run(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="runs")
    project = models.ForeignKey("projects.Project", on_delete=models.CASCADE, related_name="runs")
    name = models.CharField(max_length=200, blank=True)
    kind = models.CharField(max_length=16, choices=RunKind.choices)
    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.QUEUED)
    config = models.JSONField()
    pool = models.CharField(max_length=16, choices=Pool.choices)
    priority = models.SmallIntegerField(default=0)
    environment_version = models.ForeignKey(
        "environments.EnvironmentVersion", on_delete=models.PROTECT, null=True, blank=True,
        related_name="runs",
    )
    dataset_versions = models.ManyToManyField(
        "datasets.DatasetVersion", through="RunDataset", related_name="runs"
    )
    lease_id = models.CharField(max_length=64, blank=True)
    lease_holder = models.CharField(max_length=200, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    # The fencing token of the current lease: +1 at every claim, never reset (``attempt``
    # is the count people read and retries budget against). An attempt's checkpoints carry
    # it and live under ``checkpoints/epoch-<n>/``; a report from an older epoch is refused,
    # so a revoked attempt that writes late never becomes what the next attempt resumes.
    lease_epoch = models.PositiveBigIntegerField(default=0)
    attempt = models.PositiveIntegerField(default=0)
    # Attempts this run may make before a failure is final (automatic retries of lost or
    # failed attempts); ``retry_base`` is the attempt count when a person last queued it.
    max_attempts = models.PositiveSmallIntegerField(default=3)
    retry_base = models.PositiveIntegerField(default=0)
    environment_versions = models.ManyToManyField(
        "environments.EnvironmentVersion", through="RunEnvironment", related_name="+"
    )
    # The checkpoint of an earlier run this run starts from (pinned at launch).
    base_checkpoint = models.ForeignKey(
        "runs.Checkpoint", on_delete=models.PROTECT, null=True, blank=True,
        related_name="derived_runs",
    )
    event_seq = models.PositiveBigIntegerField(default=0)
    error = models.TextField(blank=True)
    report_uri = models.CharField(max_length=1000, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    queued_at = models.DateTimeField(null=True, blank=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)
    # Short labels frozen at launch, kept here for display (no join per table row); filters
    # go through ``RunTag``, which indexes them portably on SQLite and PostgreSQL.
    tags = models.JSONField(default=list, blank=True)
    # What the scheduler reads (workers.scheduling.spec.Resources as JSON, frozen at launch)
    # and the priority class it orders by; ``priority`` above stays the pool queue's order.
    resources = models.JSONField(default=dict, blank=True)
    priority_class = models.CharField(max_length=64, blank=True)
    # Written by each admission pass while the run is queued (blank once admitted).
    wait_reason = models.CharField(max_length=200, blank=True)
    queue_position = models.PositiveIntegerField(null=True, blank=True)
    estimated_start_at = models.DateTimeField(null=True, blank=True)
    # Times the scheduler stopped this run to make room (not failures: no attempt counted).
    preemptions = models.PositiveIntegerField(default=0)
    # Set when the scheduler asked the run to checkpoint and stop; past it, the lease is
    # revoked.
    preempt_deadline_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            # The runs table's default order (newest first, id breaks ties) within a team.
            models.Index(fields=["team", "-created_at", "-id"], name="run_team_created_id"),
            models.Index(fields=["status", "pool", "priority", "created_at"]),
            models.Index(fields=["status", "lease_expires_at"]),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.id} ({self.status})"


class RunTagManager(models.Manager["RunTag"]):
    def freeze(self, run: Run, tags: list[str] | tuple[str, ...]) -> None:
        """Give a just-created run its validated tags (the display copy and the filter
        rows), in the caller's transaction so a run never exists half-tagged."""
        if not tags:
            return
        run.tags = list(tags)
        Run.objects.filter(pk=run.pk).update(tags=run.tags)
        self.bulk_create(RunTag(run=run, team_id=run.team_id, tag=t) for t in tags)


class RunTag(models.Model):
    """One tag of one run: a row per tag so ``?tag=`` is an indexed equality lookup on
    both SQLite and PostgreSQL (JSON containment is PostgreSQL-only in Django)."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="tag_rows")
    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    tag = models.CharField(max_length=40)

    objects = RunTagManager()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "tag"], name="uniq_run_tag")]
        indexes = [models.Index(fields=["team", "tag", "run"], name="runtag_team_tag_run")]

    def __str__(self) -> str:
        return f"{self.run_id}:{self.tag}"


class RunDataset(models.Model):
    """A dataset version pinned by a run at launch, under the alias the config uses."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="pins")
    dataset_version = models.ForeignKey(
        "datasets.DatasetVersion", on_delete=models.PROTECT, related_name="+"
    )
    alias = models.CharField(max_length=64)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "alias"], name="uniq_run_alias")]

    def __str__(self) -> str:
        return f"{self.run_id}:{self.alias}"


class RunEnvironment(models.Model):
    """An environment version pinned by a run at launch (a run may train on several);
    ``Run.environment_version`` keeps the first one for simple filters."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="environment_pins")
    environment_version = models.ForeignKey(
        "environments.EnvironmentVersion", on_delete=models.PROTECT, related_name="+"
    )
    position = models.PositiveSmallIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run", "environment_version"], name="uniq_run_env")
        ]
        ordering = ["position"]

    def __str__(self) -> str:
        return f"{self.run_id}:{self.environment_version_id}"


class AttemptOutcome(models.TextChoices):
    ACTIVE = "active"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"
    LOST = "lost"  # the worker's lease expired (killed, hung, or cut off)
    PREEMPTED = "preempted"  # the scheduler took its resources back; not a failure
    DRAINED = "drained"  # its worker shut down gracefully (checkpointed, lease released)


class RunAttempt(models.Model):
    """One claim of a run by a worker, kept with its outcome and error, so a run that was
    retried shows why each earlier attempt ended."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField()
    worker = models.CharField(max_length=200, blank=True)
    outcome = models.CharField(max_length=16, choices=AttemptOutcome.choices,
                               default=AttemptOutcome.ACTIVE)
    error = models.TextField(blank=True)
    claimed_at = models.DateTimeField(default=timezone.now)
    ended_at = models.DateTimeField(null=True, blank=True)
    # When the worker began work after its startup (claim, probes, checkpoint and model
    # fetched) and the checkpoint step it resumed from (0: fresh): what goodput needs to tell
    # startup from work and work kept from work redone (apps.runs.goodput).
    started_at = models.DateTimeField(null=True, blank=True)
    resume_step = models.PositiveBigIntegerField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run", "number"], name="uniq_run_attempt")
        ]
        ordering = ["number"]

    def __str__(self) -> str:
        return f"{self.run_id}#{self.number} {self.outcome}"


class EventLevel(models.TextChoices):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class RunEvent(models.Model):
    """Append-only log of a run. ``seq`` is the event's position in the run's live stream,
    which metric batches share: increasing, gap-free across events and batches together."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="events")
    seq = models.PositiveBigIntegerField()
    level = models.CharField(max_length=10, choices=EventLevel.choices, default=EventLevel.INFO)
    kind = models.CharField(max_length=32, default="log")
    message = models.TextField()
    data = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "seq"], name="uniq_event_seq")]

    def __str__(self) -> str:
        return f"{self.run_id}#{self.seq} {self.message[:40]}"


class Checkpoint(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="checkpoints")
    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    step = models.PositiveBigIntegerField()
    uri = models.CharField(max_length=1000)
    metrics = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    # Holds the training state a resume needs (a periodic checkpoint), not only the model.
    resumable = models.BooleanField(default=False)
    # When ``checkpoint.keep`` removed its object from the store; the row stays (history,
    # metrics, lineage) but nothing can start from it.
    pruned_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "step"], name="uniq_ckpt_step")]

    def __str__(self) -> str:
        return f"{self.run_id}@{self.step}"


class Sample(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="samples")
    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    step = models.PositiveBigIntegerField()
    prompt = models.TextField()
    completion = models.TextField()
    reward = models.FloatField(null=True, blank=True)
    reward_components = models.JSONField(default=dict, blank=True)
    # RL samples: the group-relative advantage the update used, the policy version that
    # generated the completion, and why generation stopped (stop | length).
    advantage = models.FloatField(null=True, blank=True)
    weight_version = models.PositiveBigIntegerField(null=True, blank=True)
    finish_reason = models.CharField(max_length=32, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["run", "step"])]

    def __str__(self) -> str:
        return f"{self.run_id}@{self.step}"
