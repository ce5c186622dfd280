"""Team pages: members and roles, the caller's API tokens, and the team's worker tokens.

Every write goes through ``apps.teams.services`` (audit rows, owner rules). A new token's
secret is rendered once, in the response to the POST that made it, and never again."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils.cache import add_never_cache_headers

from apps.core import selectors as audit_selectors
from apps.core.actor import Actor
from apps.core.audit_api import filters_from
from apps.core.exceptions import DomainError
from apps.core.pages import page_context, team_for_page
from apps.teams import selectors, services
from apps.teams.models import ApiToken, Membership, Role, TokenKind, role_at_least


def _page(request: HttpRequest, team, membership, *, new_token=None, status=200,  # noqa: ANN001
          form_errors=None) -> HttpResponse:
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
    }
    return render(request, "teams/team.html", context, status=status)


@login_required
def team_page(request: HttpRequest, team: str) -> HttpResponse:
    """GET shows the page; POST does one operation, named by the form's ``op`` field (one
    URL for the page and its forms, so every team URL is a page a viewer can open)."""
    team_obj, membership = team_for_page(request, team)
    if request.method != "POST":
        return _page(request, team_obj, membership)
    op = request.POST.get("op", "")
    handlers = {"token-create": _token_create, "token-revoke": _token_revoke,
                "member-add": _member_add, "member-change": _member_change}
    if op not in handlers:
        return _page(request, team_obj, membership, status=400,
                     form_errors={"op": f"Unknown operation '{op[:40]}'."})
    return handlers[op](request, team_obj, membership)


def _name(request: HttpRequest) -> str:
    return (request.POST.get("name") or "").strip()[:100]


def _token_create(request: HttpRequest, team_obj, membership) -> HttpResponse:  # noqa: ANN001
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


def _token_revoke(request: HttpRequest, team_obj, membership) -> HttpResponse:  # noqa: ANN001
    prefix = request.POST.get("prefix", "")
    mine = ApiToken.objects.filter(kind=TokenKind.PERSONAL, user=request.user, prefix=prefix)
    token = mine.first()
    if token is None and role_at_least(membership.role, Role.ADMIN):
        token = ApiToken.objects.filter(kind=TokenKind.WORKER, team=team_obj,
                                        prefix=prefix).first()
    if token is None:
        raise Http404("No such token.")
    services.token_revoke(actor=Actor.of_user(request.user), token=token)
    messages.success(request, f"Token {token.prefix}… ({token.name}) revoked.")
    return redirect("team-page", team=team_obj.slug)


def _member_add(request: HttpRequest, team_obj, membership) -> HttpResponse:  # noqa: ANN001
    if not role_at_least(membership.role, Role.ADMIN):
        raise Http404("Only team admins manage members.")
    username = (request.POST.get("username") or "").strip()
    role = request.POST.get("role") or Role.MEMBER
    if role not in Role.values or not username:
        return _page(request, team_obj, membership, status=400,
                     form_errors={"member": "Give a username and one of the roles."})
    try:
        services.membership_add(actor=Actor.of_user(request.user), team=team_obj,
                                username=username, role=role)
    except DomainError as exc:
        return _page(request, team_obj, membership, status=exc.status_code,
                     form_errors={"member": exc.message})
    messages.success(request, f"{username} added as {role}.")
    return redirect("team-page", team=team_obj.slug)


def _member_change(request: HttpRequest, team_obj, membership) -> HttpResponse:  # noqa: ANN001
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


@login_required
def audit_page(request: HttpRequest, team: str) -> HttpResponse:
    """The team's audit log for its admins (the same rows and filters as
    ``GET /api/v1/teams/<team>/audit-log``), newest first, 50 a page (``?before=<id>``)."""
    team_obj, membership = team_for_page(request, team)
    if not role_at_least(membership.role, Role.ADMIN):
        raise Http404("Only team admins read the audit log.")
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
