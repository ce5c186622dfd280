"""Audit logging, called by services inside their transaction."""

from __future__ import annotations

from typing import Any

from apps.core.actor import Actor
from apps.core.models import AuditLog


def record_many(*, actor: Actor | None, rows: list[dict[str, Any]]) -> None:
    """One audit row per item of a batch write (e.g. a batch of sandbox executions), in
    one INSERT. Each row is ``{"action", "team_id", "target_type", "target_id", "data"}``."""
    AuditLog.objects.bulk_create(
        AuditLog(team_id=r["team_id"], actor=actor.user if actor else None,
                 actor_label=actor.label if actor else "system", action=r["action"],
                 target_type=r.get("target_type", ""), target_id=str(r.get("target_id", "")),
                 data=r.get("data") or {})
        for r in rows
    )


def record(
    *,
    actor: Actor | None,
    action: str,
    team_id: int | None,
    target_type: str = "",
    target_id: object = "",
    data: dict[str, Any] | None = None,
) -> AuditLog:
    return AuditLog.objects.create(
        team_id=team_id,
        actor=actor.user if actor else None,
        actor_label=actor.label if actor else "system",
        action=action,
        target_type=target_type,
        target_id=str(target_id),
        data=data or {},
    )
