"""Audit logging, called by services inside their transaction."""

from __future__ import annotations

from typing import Any

from apps.core.actor import Actor
from apps.core.models import AuditLog


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
