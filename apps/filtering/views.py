"""``/t/<team>/filtering/``: the team's output-filter policy (admins change it; everyone
in the team sees it) and the newest findings."""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from apps.core.actor import Actor
from apps.filtering import selectors, services
from apps.filtering.models import Surface
from apps.teams.models import Membership, Role, Team
from apps.teams.pages import page_context, team_page
from workers.filtering import KINDS, Mode

RECENT = 50


@team_page(write=Role.ADMIN, refused="Only team admins change the output filter.")
def filtering_page(request: HttpRequest, team_obj: Team, membership: Membership
                   ) -> HttpResponse:
    if request.method == "POST":
        modes = {s.value: request.POST.get(s.value, "") for s in Surface}
        bad = {k: v for k, v in modes.items() if v not in Mode._value2member_map_}
        if bad:
            messages.error(request, "Unknown mode for " + ", ".join(sorted(bad))
                           + "; choose off, flag, redact or block.")
            return _render(request, team_obj, membership, status=400)
        services.set_policy(actor=Actor.of_user(request.user), team=team_obj, **modes)
        messages.success(request, "Output filter saved.")
        return redirect("team-filtering", team=team_obj.slug)
    return _render(request, team_obj, membership)


def _render(request: HttpRequest, team: Team, membership: Membership, *, status: int = 200
            ) -> HttpResponse:
    policy = selectors.policy(team.pk)
    surfaces = [{"key": s.value, "label": s.label, "mode": getattr(policy, s.value)}
                for s in Surface]
    context = page_context(request, team, membership, section="team", policy=policy,
                           surfaces=surfaces, modes=[m.value for m in Mode], kinds=KINDS,
                           findings=selectors.findings(team.pk)[:RECENT])
    return render(request, "filtering/policy.html", context, status=status)
