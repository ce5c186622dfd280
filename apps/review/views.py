"""The review queue page: keyboard-driven spot-checks of sampled batch records.

The page is rendered on the server; its small script (static/review/review.js) claims the
focused item and posts verdicts through the JSON API, then swaps in a fresh render of the
queue (the same view, asked by htmx for the partial).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from apps.datasets.manifests import present
from apps.review import selectors
from apps.review.models import OPEN_BATCH_STATUSES, Batch
from apps.teams.models import Membership, Role, Team, role_at_least
from apps.teams.pages import team_page
from apps.teams.selectors import teams_for_user


def _batch(team: Any, raw: str) -> Batch | None:
    try:
        batch_id = uuid.UUID(raw)
    except ValueError as exc:
        raise Http404("No such batch.") from exc
    batch = selectors.team_batches(team).filter(pk=batch_id).first()
    if batch is None:
        raise Http404("No such batch.")
    return batch


@team_page()
def review_queue(request: HttpRequest, team_obj: Team, membership: Membership) -> HttpResponse:
    batch = _batch(team_obj, request.GET["batch"]) if request.GET.get("batch") else None
    items = selectors.queue(team_obj, batch=batch)
    if batch is not None:
        batches = [batch]
    else:
        batches = list(selectors.team_batches(team_obj).filter(status__in=OPEN_BATCH_STATUSES))
    now = timezone.now()
    rows = []
    for item in items:
        holder = item.lock_holder(now)
        trail = item.trail if isinstance(item.trail, list) else [item.trail]
        record = {k: v for k, v in item.record.items() if k != "verification"}
        rows.append({
            "item": item,
            "holder": holder,
            "mine": holder is not None and holder.pk == request.user.pk,
            "record_json": json.dumps(record, indent=2, sort_keys=True, ensure_ascii=False),
            "fields": _readable(record),
            "trail": [step if isinstance(step, dict) else {"detail": step} for step in trail],
        })
    context = {
        "team": team_obj, "membership": membership, "section": "review",
        "teams": teams_for_user(request.user).order_by("slug"),
        "can_review": role_at_least(membership.role, Role.MEMBER),
        "batch": batch, "batches": [(b, present(b.manifest)) for b in batches],
        "rows": rows, "open_count": sum(1 for r in rows if r["item"].status == "open"),
        "recent": list(selectors.team_batches(team_obj).exclude(
            status__in=OPEN_BATCH_STATUSES)[:10]) if batch is None else [],
    }
    template = "review/_queue.html" if request.htmx else "review/queue.html"
    return render(request, template, context)


# Fields a reader looks for first, in this order; the rest follow alphabetically.
LEADING_FIELDS = ("question", "problem", "prompt", "answer", "solution", "reference",
                  "completion", "chosen", "rejected")


def _readable(record: dict) -> list[tuple[str, str, bool]]:
    """(field, text, is_code) for each top-level field: text as it is, structures as
    indented JSON (``problem: {"expression": …}`` reads better than one JSON blob)."""
    keys = [k for k in LEADING_FIELDS if k in record]
    keys += sorted(k for k in record if k not in keys)
    out = []
    for key in keys:
        value = record[key]
        if isinstance(value, str):
            out.append((key, value, False))
        else:
            out.append((key, json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True),
                        True))
    return out
