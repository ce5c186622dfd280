"""Access helpers: "not yours" and "does not exist" give the same 404."""

from __future__ import annotations

from typing import Any

from apps.core.exceptions import NotFound
from apps.teams.models import Membership, Team


def access_team(user: Any, slug: str) -> tuple[Team, Membership]:
    if not getattr(user, "is_authenticated", False) or getattr(user, "pk", None) is None:
        raise NotFound(f"Team '{slug}' not found.")
    membership = (
        Membership.objects.select_related("team").filter(team__slug=slug, user=user).first()
    )
    if membership is None:
        raise NotFound(f"Team '{slug}' not found.")
    return membership.team, membership
