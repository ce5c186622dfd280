"""What every team page of the dashboard starts from: the team (a 404 page for non-members,
as the API gives 404), the roles each HTTP method needs (declared once per page with
:func:`team_page`, as the API's viewsets declare theirs), and the template context the base
layout needs."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse

from apps.core.exceptions import NotFound
from apps.teams.access import access_team
from apps.teams.models import Membership, Role, Team, role_at_least
from apps.teams.selectors import teams_for_user


def team_for_page(request: HttpRequest, slug: str) -> tuple[Team, Membership]:
    try:
        return access_team(request.user, slug)
    except NotFound as exc:
        raise Http404(exc.message) from exc


#: Methods that only read; every other method needs the page's ``write`` role.
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
TeamView = Callable[..., HttpResponse]


def team_page(*, read: str = Role.VIEWER, write: str = Role.MEMBER,
              refused: str = "") -> Callable[[TeamView], TeamView]:
    """A team page: log-in required; the ``team`` slug in the URL resolved to the team and
    the caller's membership before the view runs (404 for non-members); the role checked
    per method: below ``read`` the page does not exist for them (404), below ``write`` a
    write is refused (403, with ``refused`` as the reason). The view is called as
    ``view(request, team, membership, **other_url_kwargs)``."""
    def decorate(view: TeamView) -> TeamView:
        @login_required
        @wraps(view)
        def page(request: HttpRequest, team: str, **kwargs: Any) -> HttpResponse:
            team_obj, membership = team_for_page(request, team)
            if not role_at_least(membership.role, read):
                raise Http404(refused or f"Team '{team}' not found.")
            if request.method not in READ_METHODS and not role_at_least(membership.role, write):
                raise PermissionDenied(refused or f"This needs the {write} role; you are "
                                                  f"{membership.role}.")
            return view(request, team_obj, membership, **kwargs)

        # Declared on the view for tests/apps/api/test_urlconf.py (every team page has it).
        page.__dict__["team_roles"] = {"read": read, "write": write}
        return page

    return decorate


def page_context(request: HttpRequest, team: Team, membership: Membership,
                 **extra: Any) -> dict[str, Any]:
    """Team switcher, role flags for the templates, then the page's own values."""
    return {"team": team, "membership": membership,
            "can_write": role_at_least(membership.role, Role.MEMBER),
            "is_admin": role_at_least(membership.role, Role.ADMIN),
            "teams": teams_for_user(request.user).order_by("slug"), **extra}
