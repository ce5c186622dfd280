"""Reads of the cross-cutting records: a team's audit log, filtered."""

from __future__ import annotations

from datetime import datetime

from django.db.models import Q, QuerySet

from apps.core.models import AuditLog


def audit_log(
    *, team_id: int, actor: str = "", action: str = "", target_type: str = "",
    target_id: str = "", since: datetime | None = None, until: datetime | None = None,
) -> QuerySet[AuditLog]:
    """The team's audit rows, newest first. ``actor`` is a username or an actor label
    (``worker:<prefix>``, ``system``); ``action`` ending in ``.`` or ``*`` is a prefix
    (``run.`` = every run action); ``since`` inclusive, ``until`` exclusive."""
    rows = AuditLog.objects.filter(team_id=team_id).select_related("actor")
    if actor:
        rows = rows.filter(Q(actor__username=actor) | Q(actor_label=actor)
                           | Q(actor_label__startswith=f"{actor}/"))
    if action:
        prefix = action.rstrip("*")
        rows = (rows.filter(action__startswith=prefix) if action.endswith((".", "*"))
                else rows.filter(action=action))
    if target_type:
        rows = rows.filter(target_type=target_type)
    if target_id:
        rows = rows.filter(target_id=target_id)
    if since is not None:
        rows = rows.filter(created_at__gte=since)
    if until is not None:
        rows = rows.filter(created_at__lt=until)
    return rows.order_by("-id")
