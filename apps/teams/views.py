"""Team pages: members and roles, the caller's API tokens, and the team's worker tokens;
and the dashboard's 404 page, which lists the caller's teams.

Every write goes through ``apps.teams.services`` (audit rows, owner rules). A new token's
secret is rendered once, in the response to the POST that made it, and never again."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.cache import add_never_cache_headers
from rest_framework.exceptions import Throttled

from apps.core import selectors as audit_selectors
from apps.core.actor import Actor
from apps.core.errors import api_not_found
from apps.core.exceptions import DomainError
from apps.teams import pages, selectors, services
from apps.teams.api import accept_throttled
from apps.teams.audit_api import filters_from
from apps.teams.models import ApiToken, Invitation, Membership, Role, Team, TokenKind, role_at_least
from apps.teams.pages import page_context


def _page(request: HttpRequest, team, membership, *, new_token=None, status=200,
          form_errors=None, new_invite=None) -> HttpResponse:
    is_admin = role_at_least(membership.role, Role.ADMIN)
    context = {
        "team": team, "membership": membership, "section": "team",
        "teams": selectors.teams_for_user(request.user).order_by("slug"),
        "can_write": role_at_least(membership.role, Role.MEMBER), "is_admin": is_admin,
        "is_owner": membership.role == Role.OWNER,
        "members": Membership.objects.filter(team=team).select_related("user")
        .order_by("created_at"),
        "roles": Role.choices,
        "personal_tokens": selectors.personal_tokens(request.user).order_by("-created_at"),
        "worker_tokens": (ApiToken.objects.filter(kind=TokenKind.WORKER, team=team)
                          .select_related("created_by").order_by("-created_at")
                          if is_admin else []),
        "new_token": new_token, "form_errors": form_errors or {},
        "invitations": (Invitation.objects.filter(team=team, revoked_at__isnull=True)
                        .select_related("created_by").order_by("-created_at")[:50]
                        if is_admin else []),
        "new_invite": new_invite,
    }
    return render(request, "teams/team.html", context, status=status)


@pages.team_page(write=Role.VIEWER)
def team_page(request: HttpRequest, team_obj: Team, membership: Membership) -> HttpResponse:
    """GET shows the page; POST does one operation, named by the form's ``op`` field (one
    URL for the page and its forms, so every team URL is a page a viewer can open)."""
    if request.method != "POST":
        return _page(request, team_obj, membership)
    op = request.POST.get("op", "")
    handlers = {"token-create": _token_create, "token-revoke": _token_revoke,
                "invite-create": _invite_create, "invite-revoke": _invite_revoke,
                "member-change": _member_change}
    if op not in handlers:
        return _page(request, team_obj, membership, status=400,
                     form_errors={"op": f"Unknown operation '{op[:40]}'."})
    return handlers[op](request, team_obj, membership)


def _name(request: HttpRequest) -> str:
    return (request.POST.get("name") or "").strip()[:100]


def _token_create(request: HttpRequest, team_obj, membership) -> HttpResponse:
    kind = request.POST.get("kind", "")
    name = _name(request)
    if kind not in ("personal", "worker"):
        raise Http404("No such token kind.")
    if kind == "worker" and not role_at_least(membership.role, Role.ADMIN):
        raise Http404("Only team admins manage worker tokens.")
    if not name:
        return _page(request, team_obj, membership, status=400,
                     form_errors={kind: "Give the token a name, e.g. the machine or script "
                                        "that will use it."})
    actor = Actor.of_user(request.user)
    if kind == "personal":
        token, raw = services.personal_token_create(actor=actor, user=request.user, name=name)
    else:
        token, raw = services.worker_token_create(actor=actor, team=team_obj, name=name)
    response = _page(request, team_obj, membership, new_token={"token": token, "secret": raw},
                     status=201)
    add_never_cache_headers(response)  # the page holds a secret shown once
    return response


def _token_revoke(request: HttpRequest, team_obj, membership) -> HttpResponse:
    prefix = request.POST.get("prefix", "")
    # A team page: the caller is logged in, never AnonymousUser.
    mine = ApiToken.objects.filter(kind=TokenKind.PERSONAL, user=request.user,  # type: ignore[misc]
                                   prefix=prefix)
    token = mine.first()
    if token is None and role_at_least(membership.role, Role.ADMIN):
        token = ApiToken.objects.filter(kind=TokenKind.WORKER, team=team_obj,
                                        prefix=prefix).first()
    if token is None:
        raise Http404("No such token.")
    services.token_revoke(actor=Actor.of_user(request.user), token=token)
    messages.success(request, f"Token {token.prefix}… ({token.name}) revoked.")
    return redirect("team-page", team=team_obj.slug)


def _invite_create(request: HttpRequest, team_obj, membership) -> HttpResponse:
    """An invite code, shown once on the response page (never cached)."""
    if not role_at_least(membership.role, Role.ADMIN):
        raise Http404("Only team admins invite members.")
    role = request.POST.get("role") or Role.MEMBER
    try:
        uses = int(request.POST.get("max_uses") or 1)
        hours = int(request.POST.get("expires_in_hours") or services.INVITE_HOURS_DEFAULT)
        invitation, code = services.invitation_create(
            actor=Actor.of_user(request.user), team=team_obj, role=role, hours=hours,
            max_uses=uses)
    except ValueError:
        return _page(request, team_obj, membership, status=400,
                     form_errors={"invite": "Uses and hours must be whole numbers."})
    except DomainError as exc:
        return _page(request, team_obj, membership, status=exc.status_code,
                     form_errors={"invite": exc.message})
    response = _page(request, team_obj, membership, status=201,
                     new_invite={"invitation": invitation, "code": code,
                                 "url": request.build_absolute_uri(reverse("invite-accept"))})
    add_never_cache_headers(response)
    return response


def _invite_revoke(request: HttpRequest, team_obj, membership) -> HttpResponse:
    if not role_at_least(membership.role, Role.ADMIN):
        raise Http404("Only team admins manage invitations.")
    invitation = Invitation.objects.filter(team=team_obj,
                                           prefix=request.POST.get("prefix", "")).first()
    if invitation is None:
        raise Http404("No such invitation.")
    services.invitation_revoke(actor=Actor.of_user(request.user), invitation=invitation)
    messages.success(request, f"Invitation {invitation.prefix}… revoked.")
    return redirect("team-page", team=team_obj.slug)


@login_required
def accept_invitation(request: HttpRequest) -> HttpResponse:
    """``/invite/``: a person pastes the code an admin gave them and joins that team."""
    error, status, wait = "", 200, 0
    if request.method == "POST":
        try:
            joined = accept_throttled(request, (request.POST.get("code") or "")[:200])
        except DomainError as exc:
            error, status = exc.message, exc.status_code
        except Throttled as exc:
            error, status, wait = str(exc.detail), 429, int(exc.wait or 60)
        else:
            messages.success(request, f"You joined {joined.team.name} as {joined.role}.")
            return redirect("team-runs", team=joined.team.slug)
    response = render(request, "teams/accept_invite.html",
                      {"error": error, "teams": selectors.teams_for_user(request.user)
                       .order_by("slug")}, status=status)
    if status == 429:
        response["Retry-After"] = str(max(1, wait))
    return response


def _member_change(request: HttpRequest, team_obj, membership) -> HttpResponse:
    username = request.POST.get("username", "")
    if not role_at_least(membership.role, Role.ADMIN):
        raise Http404("Only team admins manage members.")
    target = Membership.objects.filter(team=team_obj, user__username=username).select_related(
        "user", "team").first()
    if target is None:
        raise Http404("No such member.")
    actor = Actor.of_user(request.user)
    try:
        if request.POST.get("remove"):
            services.membership_remove(actor=actor, membership=target)
            messages.success(request, f"{username} removed from the team.")
        else:
            role = request.POST.get("role") or ""
            if role not in Role.values:
                raise DomainError(f"Unknown role '{role}'.")
            services.membership_change_role(actor=actor, membership=target, role=role)
            messages.success(request, f"{username} is now {role}.")
    except DomainError as exc:
        messages.error(request, exc.message)
    if username == request.user.get_username() and request.POST.get("remove"):
        return redirect("home")
    return redirect("team-page", team=team_obj.slug)


AUDIT_PAGE_SIZE = 50


@pages.team_page(read=Role.ADMIN, refused="Only team admins read the audit log.")
def audit_page(request: HttpRequest, team_obj: Team, membership: Membership) -> HttpResponse:
    """The team's audit log for its admins (the same rows and filters as
    ``GET /api/v1/teams/<team>/audit-log``), newest first, 50 a page (``?before=<id>``)."""
    error = ""
    try:
        filters = filters_from(request.GET)
    except DomainError as exc:
        filters, error = {}, exc.message
    rows = audit_selectors.audit_log(team_id=team_obj.pk, **filters)
    before = request.GET.get("before", "")
    if before.isdigit() and len(before) < 19:
        rows = rows.filter(id__lt=int(before))
    page = list(rows[:AUDIT_PAGE_SIZE + 1])
    older = None
    if len(page) > AUDIT_PAGE_SIZE:
        page = page[:AUDIT_PAGE_SIZE]
        query = request.GET.copy()
        query["before"] = str(page[-1].pk)
        older = query.urlencode()
    context = page_context(request, team_obj, membership, section="team", rows=page,
                           older=older, error=error,
                           values={k: request.GET.get(k, "") for k in
                                   ("actor", "action", "object", "since", "until")})
    return render(request, "teams/audit.html", context, status=400 if error else 200)


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """Django's 404 handler: the JSON error shape on API paths; elsewhere a page that links
    the caller's teams, so a mistyped (or not-yours) team URL is one click from theirs."""
    if request.path.startswith("/api/"):
        return api_not_found(request)
    teams: list[Team] = []
    if getattr(request, "user", None) is not None and request.user.is_authenticated:
        teams = list(selectors.teams_for_user(request.user).order_by("slug")[:20])
    return render(request, "404.html", {"user_teams": teams}, status=404)
