from __future__ import annotations

from typing import Any

from django.db.models import OuterRef, QuerySet, Subquery

from apps.teams.models import ApiToken, Membership, Team, TokenKind


def teams_for_user(user: Any) -> QuerySet[Team]:
    role = Membership.objects.filter(team=OuterRef("pk"), user=user).values("role")[:1]
    return Team.objects.filter(memberships__user=user).annotate(my_role=Subquery(role))


def personal_tokens(user: Any) -> QuerySet[ApiToken]:
    return ApiToken.objects.filter(kind=TokenKind.PERSONAL, user=user)
