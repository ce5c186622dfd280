"""``/cluster/queue/``: what waits for the cluster, queue by queue, in the order the scheduler
considers it, with why each run waits and when it may start; and each cohort's pooled quota and
use. The page form of ``GET /api/v1/cluster/queue`` (same visibility: every queue's counts, the
runs of the viewer's teams, all runs for staff). Lives in runs: it reads runs, and
apps.scheduling may not import apps.runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_http_methods

from apps.runs import scheduler, selectors
from apps.scheduling import selectors as cluster
from apps.teams.models import Membership


def describe_resources(resources: dict[str, Any] | None, pool: str) -> str:
    """A run's request as a person reads it: ``2 GPUs × 4 nodes (H100 or A100)``,
    ``1 GPU (any type)``, ``4 CPUs``. Without ``resources`` the launch default applies."""
    r = resources or {}
    gpus, nodes = int(r.get("gpus_per_node", 1 if pool == "gpu" else 0)), int(r.get("nodes", 1))
    if gpus:
        what = f"{gpus} GPU{'s' if gpus != 1 else ''}"
        types = r.get("gpu_types") or []
        kinds = " or ".join(types) if types else "any type"
    else:
        cpus = float(r.get("cpus", 1))
        what = f"{cpus:g} CPU{'s' if cpus != 1 else ''}"
        kinds = ""
    gang = f" × {nodes} nodes" if nodes > 1 else ""
    return f"{what}{gang}" + (f" ({kinds})" if kinds else "")


@dataclass
class Cohort:
    """A cohort's queues with their pooled nominal quota and use, per flavor."""

    name: str
    teams: list[str] = field(default_factory=list)
    nominal: dict[str, float] = field(default_factory=dict)
    in_use: dict[str, float] = field(default_factory=dict)
    borrowed: dict[str, dict[str, float]] = field(default_factory=dict)  # team -> flavor -> amt


def cohorts(uses: list[cluster.QueueUse]) -> list[Cohort]:
    """Pool each cohort's queues; a queue's use above its nominal is what it borrows."""
    out: dict[str, Cohort] = {}
    for use in uses:
        if not use.cohort:
            continue
        c = out.setdefault(use.cohort, Cohort(use.cohort))
        c.teams.append(use.team)
        for flavor, amount in use.nominal.items():
            c.nominal[flavor] = c.nominal.get(flavor, 0.0) + amount
        for flavor, amount in use.in_use.items():
            c.in_use[flavor] = c.in_use.get(flavor, 0.0) + amount
            over = amount - use.nominal.get(flavor, 0.0)
            if over > 0:
                c.borrowed.setdefault(use.team, {})[flavor] = over
    return [out[name] for name in sorted(out)]


@login_required
@require_http_methods(["GET", "HEAD"])
def queue_page(request: HttpRequest) -> HttpResponse:
    user = request.user
    staff = user.is_staff or user.is_superuser
    visible = None if staff else set(
        Membership.objects.filter(user=user).values_list("team_id", flat=True))
    now = timezone.now()
    queues = selectors.pending_by_queue(visible)
    for queue in queues:
        for run in queue["runs"]:
            run["asks"] = describe_resources(run["resources"], run["pool"])
            run["waiting"] = cluster.duration((now - run["queued_at"]).total_seconds()) \
                if run["queued_at"] else ""
    template = "runs/_queue.html" if request.htmx else "runs/queue.html"
    return render(request, template, {
        "section": "cluster", "now": now, "scheduler_on": scheduler.enabled(),
        "queues": queues, "cohorts": cohorts(cluster.queue_use()),
    })
