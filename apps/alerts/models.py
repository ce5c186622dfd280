"""Alert rules, the alerts they fire, and the webhook deliveries of those alerts (with one
row per attempt: the delivery log)."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from apps.alerts.rules import PARAMS


class RuleKind(models.TextChoices):
    WORKER_LOST = "worker_lost"
    NODE_LOST = "node_lost"
    QUEUE_WAIT = "queue_wait"
    NAN_STREAK = "nan_streak"
    REWARD_COLLAPSE = "reward_collapse"
    METRIC_ABOVE = "metric_above"
    MISMATCH_KL = "mismatch_kl"
    SANDBOX_ERROR_RATE = "sandbox_error_rate"
    FORGERY_SUSPECT = "forgery_suspect"


assert set(RuleKind.values) == set(PARAMS), "every rule kind has its parameters"


class AlertRule(models.Model):
    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    name = models.CharField(max_length=200)
    kind = models.CharField(max_length=32, choices=RuleKind.choices)
    params = models.JSONField(default=dict, blank=True)
    # Only runs of this project ("" = every project of the team); run rules only.
    project = models.ForeignKey("projects.Project", on_delete=models.CASCADE, null=True,
                                blank=True, related_name="+")
    enabled = models.BooleanField(default=True)
    # The same rule and subject (a run, a node, a pool) fire at most once per cooldown.
    cooldown_s = models.PositiveIntegerField(default=3600)
    webhook_url = models.CharField(max_length=2000, blank=True)
    # Standard Webhooks secret ("whsec_" + base64); shown once, when the rule is created.
    webhook_secret = models.CharField(max_length=100, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL,
                                   null=True, blank=True, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["team", "enabled", "kind"], name="alert_rule_team")]

    def __str__(self) -> str:
        return f"{self.team_id}/{self.name}"


class Alert(models.Model):
    """One firing of a rule for one subject. ``key`` identifies the subject (``run:<id>``,
    ``node:<name>``, ``pool:<name>``): the cooldown and a node loss's once-only firing key
    on it."""

    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    rule = models.ForeignKey(AlertRule, on_delete=models.CASCADE, related_name="alerts")
    run = models.ForeignKey("runs.Run", on_delete=models.CASCADE, null=True, blank=True,
                            related_name="+")
    kind = models.CharField(max_length=32, choices=RuleKind.choices)
    key = models.CharField(max_length=300)
    message = models.TextField()
    value = models.FloatField(null=True, blank=True)
    data = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["rule", "key", "created_at"], name="alert_rule_key"),
                   models.Index(fields=["team", "created_at"], name="alert_team_time"),
                   models.Index(fields=["run", "created_at"], name="alert_run_time")]

    def __str__(self) -> str:
        return f"{self.kind}:{self.key}"


class DeliveryStatus(models.TextChoices):
    PENDING = "pending"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class Delivery(models.Model):
    """One alert's webhook message: sent, retried with backoff until a 2xx or the last
    attempt. ``msg_id`` is the Standard Webhooks ``webhook-id`` (the same on every retry, so
    a receiver can drop duplicates)."""

    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    alert = models.ForeignKey(Alert, on_delete=models.CASCADE, related_name="deliveries")
    url = models.CharField(max_length=2000)
    msg_id = models.CharField(max_length=64, unique=True)
    payload = models.JSONField(default=dict)
    status = models.CharField(max_length=16, choices=DeliveryStatus.choices,
                              default=DeliveryStatus.PENDING, db_index=True)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(default=timezone.now)
    last_status_code = models.IntegerField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "deliveries"

    def __str__(self) -> str:
        return f"{self.msg_id} {self.status}"


class DeliveryAttempt(models.Model):
    """One HTTP attempt of a delivery: insert-only, the delivery log."""

    delivery = models.ForeignKey(Delivery, on_delete=models.CASCADE, related_name="log")
    number = models.PositiveIntegerField()
    status_code = models.IntegerField(null=True, blank=True)
    error = models.CharField(max_length=500, blank=True)
    response = models.CharField(max_length=500, blank=True)  # the body's first characters
    duration_ms = models.FloatField(default=0.0)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["delivery", "number"],
                                               name="uniq_delivery_attempt")]

    def __str__(self) -> str:
        return f"{self.delivery_id}#{self.number} {self.status_code or self.error[:30]}"
