"""What every team page of the dashboard starts from: the team (a 404 page for non-members,
as the API gives 404) and the template context the base layout needs."""

from __future__ import annotations

from typing import Any

from django.http import Http404, HttpRequest

from apps.core.access import access_team
from apps.core.exceptions import NotFound
from apps.teams.models import Membership, Role, Team, role_at_least
from apps.teams.selectors import teams_for_user


def team_for_page(request: HttpRequest, slug: str) -> tuple[Team, Membership]:
    try:
        return access_team(request.user, slug)
    except NotFound as exc:
        raise Http404(exc.message) from exc


def page_context(request: HttpRequest, team: Team, membership: Membership,
                 **extra: Any) -> dict[str, Any]:
    """Team switcher, role flags for the templates, then the page's own values."""
    return {"team": team, "membership": membership,
            "can_write": role_at_least(membership.role, Role.MEMBER),
            "is_admin": role_at_least(membership.role, Role.ADMIN),
            "teams": teams_for_user(request.user).order_by("slug"), **extra}
