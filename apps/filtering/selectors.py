"""Reads: a team's mode per surface, and what the filter found in given objects."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db.models import QuerySet

from apps.filtering.models import FilterPolicy, Finding, Surface
from workers.filtering import Mode


def policy(team_id: int) -> FilterPolicy:
    """The team's policy row, or an unsaved all-``off`` one for a team that never set it."""
    return FilterPolicy.objects.filter(team_id=team_id).first() or FilterPolicy(team_id=team_id)


def mode(team_id: int, surface: Surface | str) -> Mode:
    return Mode(getattr(policy(team_id), Surface(surface).value))


def findings(team_id: int) -> QuerySet[Finding]:
    return Finding.objects.filter(team_id=team_id).order_by("-created_at", "-id")


def flags_for(team_id: int, target_type: str, ids: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """``{target_id: {"action", "kinds"}}`` for those of ``ids`` the filter flagged or
    redacted (one query; the newest finding per object wins)."""
    wanted = [str(i) for i in ids]
    if not wanted:
        return {}
    out: dict[str, dict[str, Any]] = {}
    rows = (Finding.objects.filter(team_id=team_id, target_type=target_type,
                                   target_id__in=wanted)
            .order_by("created_at", "id").values("target_id", "action", "kinds"))
    for row in rows:
        out[row["target_id"]] = {"action": row["action"], "kinds": row["kinds"]}
    return out


def attach_flags(team_id: int, objs: list[Any], target_type: str = "sample") -> None:
    """Set ``filter_flag`` on each object (its finding, or None) for serializers and
    templates: one query for the page."""
    flags = flags_for(team_id, target_type, [o.pk for o in objs])
    for o in objs:
        o.filter_flag = flags.get(str(o.pk))
