"""Tenancy: teams, memberships with roles, and API tokens."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import models
from django.utils import timezone


class Role(models.TextChoices):
    VIEWER = "viewer", "Viewer"
    MEMBER = "member", "Member"
    ADMIN = "admin", "Admin"
    OWNER = "owner", "Owner"


ROLE_RANK = {Role.VIEWER: 0, Role.MEMBER: 1, Role.ADMIN: 2, Role.OWNER: 3}


def role_at_least(role: str, required: str) -> bool:
    return ROLE_RANK[Role(role)] >= ROLE_RANK[Role(required)]


class Team(models.Model):
    slug = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    created_at = models.DateTimeField(default=timezone.now)
    # Who created it: the per-user team quota (CRUCIBLE_TEAMS_PER_USER) counts these.
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True,
        related_name="+",
    )
    # Raw metric points older than this many days (by when they were ingested) are dropped by
    # the periodic prune; the rollups that charts read are kept forever. None: keep them all.
    metric_retention_days = models.PositiveIntegerField(null=True, blank=True)
    members: models.ManyToManyField[Any, Membership] = models.ManyToManyField(
        settings.AUTH_USER_MODEL, through="Membership", related_name="teams"
    )

    def __str__(self) -> str:
        return self.slug


class Membership(models.Model):
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "user"], name="uniq_membership")]

    def __str__(self) -> str:
        return f"{self.user} in {self.team} ({self.role})"


class TokenKind(models.TextChoices):
    PERSONAL = "personal", "Personal"
    WORKER = "worker", "Worker"


class ApiToken(models.Model):
    """A bearer token. Only a SHA-256 of the secret is stored; the secret is shown once.

    Personal tokens act as their user on team URLs. Worker tokens act only on worker
    endpoints, for one team's runs or (team empty, created by an operator) for every team's.
    """

    kind = models.CharField(max_length=16, choices=TokenKind.choices)
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)
    key_hash = models.CharField(max_length=64)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="api_tokens",
    )
    team = models.ForeignKey(
        Team, on_delete=models.CASCADE, null=True, blank=True, related_name="worker_tokens"
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
    )
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    #: The secret, set on the instance just created only, for the one response that shows it.
    token: str

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=(
                    models.Q(kind="personal", user__isnull=False)
                    | models.Q(kind="worker", user__isnull=True)
                ),
                name="token_kind_owner",
            )
        ]

    def __str__(self) -> str:
        return f"{self.kind}:{self.prefix} ({self.name})"

    @property
    def is_active(self) -> bool:
        now = timezone.now()
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)


class Invitation(models.Model):
    """An invite code to join a team with a role, made by an admin and handed over by any
    channel (chat, e-mail). People join by presenting the code, so adding a member never
    takes (or reveals) a username. Only a SHA-256 of the code is stored; it is shown once.
    """

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="invitations")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    prefix = models.CharField(max_length=16, unique=True)
    code_hash = models.CharField(max_length=64)
    max_uses = models.PositiveSmallIntegerField(default=1)
    uses = models.PositiveSmallIntegerField(default=0)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True,
        related_name="+",
    )
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)

    #: The code, set on the instance just created only, for the one response that shows it.
    code: str

    def __str__(self) -> str:
        return f"invitation {self.prefix} to {self.team_id} ({self.role})"

    @property
    def is_usable(self) -> bool:
        return (self.revoked_at is None and self.uses < self.max_uses
                and self.expires_at > timezone.now())
