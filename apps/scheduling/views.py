"""``/cluster/``: the inventory as a page — nodes with their GPUs, state and reason, and the
age of their last heartbeat; staff cordon, drain and uncordon from it. Not team-scoped:
every signed-in person sees the same cluster (as the API's ``/api/v1/cluster/nodes``)."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_http_methods

from apps.core.actor import Actor
from apps.core.exceptions import DomainError
from apps.scheduling import selectors, services
from apps.teams.selectors import teams_for_user

ACTIONS = {"cordon": services.cordon, "drain": services.drain, "uncordon": services.uncordon}


def _context(request: HttpRequest, **extra: Any) -> dict[str, Any]:
    now = timezone.now()
    # One slot per GPU, with the run whose allocation holds it (None: free).
    holders = selectors.gpu_holders()
    on_node = selectors.node_runs()
    rows = [(node, selectors.duration(selectors.heartbeat_age_s(node, now)),
             [(i, holders.get(node.pk, {}).get(i)) for i in range(node.gpu_count)],
             on_node.get(node.pk, []))
            for node in selectors.nodes()]
    return {"rows": rows, "totals": selectors.totals(), "now": now,
            "queues": selectors.queue_use(),
            "section": "cluster", "can_act": request.user.is_staff or request.user.is_superuser,
            "teams": teams_for_user(request.user).order_by("slug"), **extra}


@login_required
@require_http_methods(["GET", "HEAD", "POST"])
def cluster(request: HttpRequest) -> HttpResponse:
    """GET: the page (htmx: the table alone). POST ``node``, ``action``, ``reason``: staff
    change a node's state; the answer is the table again, with the outcome."""
    template = "scheduling/_nodes.html" if request.htmx else "scheduling/cluster.html"
    if request.method != "POST":
        return render(request, template, _context(request))
    if not (request.user.is_staff or request.user.is_superuser):
        raise PermissionDenied("Only staff may cordon, drain or uncordon nodes.")
    verb, name = request.POST.get("action", ""), request.POST.get("node", "")
    error, done = "", ""
    if verb not in ACTIONS:
        error = f"Unknown action {verb[:20]!r}: choose cordon, drain or uncordon."
    else:
        try:
            node = ACTIONS[verb](actor=Actor.of_user(request.user), node=name,
                                 reason=request.POST.get("reason", ""))
            done = f"{node.name} is {node.state}."
        except DomainError as exc:
            error = exc.message
    if not request.htmx:  # a plain form post: the outcome as a message, then the page
        if error:
            messages.error(request, error)
        else:
            messages.success(request, done)
        return redirect("cluster")
    return render(request, template, _context(request, error=error, error_node=name,
                                              done=done))
