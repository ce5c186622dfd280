"""Writes for teams, memberships and tokens. Each is one transaction with an audit row."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from apps.core import audit, limits
from apps.core.actor import Actor
from apps.core.exceptions import Conflict, DomainError, Forbidden, InvalidInput, NotFound
from apps.teams import tokens
from apps.teams.models import ApiToken, Invitation, Membership, Role, Team, TokenKind

User = get_user_model()


# Slugs that would read as part of the product in a URL or message; refused exactly like a
# slug another team holds, so the answer never says which it was.
RESERVED_SLUGS = frozenset({"admin", "api", "accounts", "static", "media", "new", "settings",
                            "system", "team", "teams", "www", "crucible", "healthz", "ws",
                            "me", "invitations", "worker"})


class TeamQuotaExceeded(DomainError):
    status_code = 403
    code = "quota_exceeded"


@transaction.atomic
def team_create(*, actor: Actor, slug: str, name: str) -> Team:
    """A new team owned by ``actor``. A person may create at most CRUCIBLE_TEAMS_PER_USER
    teams (operators' commands and superusers are not limited). A slug that is taken, by a
    team the caller may not even see, or reserved gets one answer: not available."""
    user = actor.user
    if user is not None and not getattr(user, "is_superuser", False):
        # Serialise one user's concurrent creations so the count cannot be raced past.
        User.objects.select_for_update().filter(pk=user.pk).first()
        quota = settings.CRUCIBLE["TEAMS_PER_USER"]
        made = Team.objects.filter(created_by=user).count()
        if made >= quota:
            raise TeamQuotaExceeded(
                f"You have created {made} teams, the most one person may create "
                f"(CRUCIBLE_TEAMS_PER_USER={quota}); ask to join an existing team instead, or "
                "ask the operator to raise the quota.")
    if slug.lower() in RESERVED_SLUGS or Team.objects.filter(slug__iexact=slug).exists():
        raise Conflict(f"The team slug '{slug}' is not available; pick another slug.",
                       code="slug_unavailable")
    team = Team.objects.create(slug=slug, name=name or slug, created_by=user)
    if actor.user is not None:
        Membership.objects.create(team=team, user=actor.user, role=Role.OWNER)
    audit.record(actor=actor, action="team.create", team_id=team.pk, target_type="team",
                 target_id=team.slug)
    return team


_UNSET: Any = object()


@transaction.atomic
def team_update(*, actor: Actor, team: Team, name: str | None = None,
                metric_retention_days: int | None = _UNSET) -> Team:
    """Rename the team and/or set how many days of raw metric points it keeps (None: all)."""
    changed: dict[str, Any] = {}
    if name is not None:
        limits.check_text(name, field="name", limit=limits.NAME)
        team.name = changed["name"] = name
    if metric_retention_days is not _UNSET:
        team.metric_retention_days = changed["metric_retention_days"] = metric_retention_days
    if changed:
        team.save(update_fields=list(changed))
    audit.record(actor=actor, action="team.update", team_id=team.pk, target_type="team",
                 target_id=team.slug, data=changed)
    return team


@transaction.atomic
def membership_add(*, actor: Actor, team: Team, username: str, role: str) -> Membership:
    """Add a user by name: for operators (Django admin, shell). People join through
    invitations, so the API and pages never answer whether a username exists."""
    user = User.objects.filter(username=username).first()
    if user is None:
        raise NotFound(f"No user '{username}'.")
    _check_grant(actor, team, role)
    if Membership.objects.filter(team=team, user=user).exists():
        raise Conflict(f"'{username}' is already a member of '{team.slug}'.")
    membership = Membership.objects.create(team=team, user=user, role=role)
    audit.record(actor=actor, action="membership.add", team_id=team.pk, target_type="user",
                 target_id=username, data={"role": role})
    return membership


@transaction.atomic
def membership_change_role(*, actor: Actor, membership: Membership, role: str) -> Membership:
    membership = Membership.objects.select_for_update().get(pk=membership.pk)
    # Taking ownership away needs an owner as much as granting it does.
    _check_grant(actor, membership.team, Role.OWNER if membership.role == Role.OWNER else role)
    if membership.role == Role.OWNER and role != Role.OWNER:
        _ensure_other_owner(membership)
    old = membership.role
    membership.role = role
    membership.save(update_fields=["role"])
    audit.record(actor=actor, action="membership.role", team_id=membership.team_id,
                 target_type="user", target_id=membership.user.username,
                 data={"from": old, "to": role})
    return membership


@transaction.atomic
def membership_remove(*, actor: Actor, membership: Membership) -> None:
    if membership.role == Role.OWNER:
        _ensure_other_owner(membership)
        _check_grant(actor, membership.team, Role.OWNER)
    audit.record(actor=actor, action="membership.remove", team_id=membership.team_id,
                 target_type="user", target_id=membership.user.username)
    membership.delete()


def _check_grant(actor: Actor, team: Team, role: str) -> None:
    """Only owners grant or take away ownership."""
    if role != Role.OWNER or actor.user is None:
        return
    mine = Membership.objects.filter(team=team, user=actor.user).values_list("role", flat=True)
    if Role.OWNER not in mine:
        raise Forbidden("Only an owner can grant or remove the owner role.")


def _ensure_other_owner(membership: Membership) -> None:
    owners = Membership.objects.filter(team_id=membership.team_id, role=Role.OWNER)
    if not owners.exclude(pk=membership.pk).exists():
        raise Conflict("A team needs at least one owner; make someone else owner first.")


def _validate_expiry(expires_at: datetime | None) -> None:
    if expires_at is not None and expires_at <= timezone.now():
        raise InvalidInput("expires_at must be in the future.", details={"expires_at": ["past"]})


@transaction.atomic
def personal_token_create(
    *, actor: Actor, user: Any, name: str, expires_at: datetime | None = None
) -> tuple[ApiToken, str]:
    _validate_expiry(expires_at)
    raw, prefix, digest = tokens.generate(tokens.PERSONAL_SCHEME)
    token = ApiToken.objects.create(
        kind=TokenKind.PERSONAL, name=name, prefix=prefix, key_hash=digest, user=user,
        created_by=actor.user, expires_at=expires_at,
    )
    audit.record(actor=actor, action="token.create", team_id=None, target_type="token",
                 target_id=prefix, data={"kind": "personal", "name": name})
    return token, raw


@transaction.atomic
def worker_token_create(
    *, actor: Actor, team: Team | None, name: str, expires_at: datetime | None = None
) -> tuple[ApiToken, str]:
    """A worker token for one team's runs, or for every team's when ``team`` is None."""
    _validate_expiry(expires_at)
    raw, prefix, digest = tokens.generate(tokens.WORKER_SCHEME)
    token = ApiToken.objects.create(
        kind=TokenKind.WORKER, name=name, prefix=prefix, key_hash=digest, team=team,
        created_by=actor.user, expires_at=expires_at,
    )
    audit.record(actor=actor, action="token.create", team_id=team.pk if team else None,
                 target_type="token", target_id=prefix, data={"kind": "worker", "name": name})
    return token, raw


@transaction.atomic
def token_revoke(*, actor: Actor, token: ApiToken) -> ApiToken:
    token = ApiToken.objects.select_for_update().get(pk=token.pk)
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
        audit.record(actor=actor, action="token.revoke", team_id=token.team_id,
                     target_type="token", target_id=token.prefix)
    return token


# --- invitations ----------------------------------------------------------------------------

INVITE_HOURS_DEFAULT = 24 * 7
INVITE_HOURS_MAX = 24 * 30
INVITE_USES_MAX = 100
INVALID_INVITE = ("This invitation code is not valid: it may be mistyped, expired, revoked or "
                  "used up. Ask a team admin for a new one.")


@transaction.atomic
def invitation_create(
    *, actor: Actor, team: Team, role: str = Role.MEMBER, hours: int = INVITE_HOURS_DEFAULT,
    max_uses: int = 1,
) -> tuple[Invitation, str]:
    """An invite code for ``team`` with ``role`` (owner only from an owner); returns
    (invitation, code). The code is shown once; only its hash is kept."""
    if role not in Role.values:
        raise InvalidInput(f"Unknown role '{role}'.", details={"role": [role]})
    if not 1 <= hours <= INVITE_HOURS_MAX:
        raise InvalidInput(f"expires_in_hours must be between 1 and {INVITE_HOURS_MAX}.",
                           details={"expires_in_hours": [str(hours)]})
    if not 1 <= max_uses <= INVITE_USES_MAX:
        raise InvalidInput(f"max_uses must be between 1 and {INVITE_USES_MAX}.",
                           details={"max_uses": [str(max_uses)]})
    _check_grant(actor, team, role)
    code, prefix, digest = tokens.generate(tokens.INVITE_SCHEME)
    invitation = Invitation.objects.create(
        team=team, role=role, prefix=prefix, code_hash=digest, max_uses=max_uses,
        created_by=actor.user, expires_at=timezone.now() + timedelta(hours=hours),
    )
    audit.record(actor=actor, action="invitation.create", team_id=team.pk,
                 target_type="invitation", target_id=prefix,
                 data={"role": role, "max_uses": max_uses,
                       "expires_at": invitation.expires_at.isoformat()})
    return invitation, code


@transaction.atomic
def invitation_revoke(*, actor: Actor, invitation: Invitation) -> Invitation:
    invitation = Invitation.objects.select_for_update().get(pk=invitation.pk)
    if invitation.revoked_at is None:
        invitation.revoked_at = timezone.now()
        invitation.save(update_fields=["revoked_at"])
        audit.record(actor=actor, action="invitation.revoke", team_id=invitation.team_id,
                     target_type="invitation", target_id=invitation.prefix)
    return invitation


class InvalidInvitation(NotFound):
    code = "invalid_invitation"


def invitation_accept(*, actor: Actor, code: str) -> Membership:
    """Join the code's team with its role. Every way a code can fail (malformed, unknown,
    wrong secret, expired, revoked, used up) gives the same 404, so a code reveals nothing
    until it works; failed tries count toward the caller's address limit (the view's)."""
    prefix = tokens.parse_invite_prefix(code.strip())
    with transaction.atomic():
        invitation = (Invitation.objects.select_for_update().select_related("team")
                      .filter(prefix=prefix).first() if prefix else None)
        if (invitation is None or not tokens.matches(code.strip(), invitation.code_hash)
                or not invitation.is_usable):
            raise InvalidInvitation(INVALID_INVITE)
        if Membership.objects.filter(team=invitation.team, user=actor.user).exists():
            raise Conflict(f"You are already a member of '{invitation.team.slug}'; the "
                           "invitation was not used.", code="already_member")
        membership = Membership.objects.create(team=invitation.team, user=actor.user,
                                               role=invitation.role)
        invitation.uses += 1
        invitation.save(update_fields=["uses"])
        audit.record(actor=actor, action="membership.add", team_id=invitation.team_id,
                     target_type="user", target_id=actor.label,
                     data={"role": invitation.role, "invitation": invitation.prefix})
    return membership
