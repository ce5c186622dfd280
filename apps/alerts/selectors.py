"""Reads for alerts: a team's alerts (optionally of one run) and deliveries with their log."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from apps.alerts.models import Alert, AlertRule, Delivery


def alerts_for(team_id: int, *, run_id: Any = None, rule_id: Any = None) -> QuerySet[Alert]:
    found = Alert.objects.filter(team_id=team_id).select_related("rule")
    if run_id is not None:
        found = found.filter(run_id=run_id)
    if rule_id is not None:
        found = found.filter(rule_id=rule_id)
    return found


def deliveries_for(team_id: int) -> QuerySet[Delivery]:
    return Delivery.objects.filter(team_id=team_id).select_related("alert").prefetch_related(
        "log")


def rules_for(team_id: int) -> QuerySet[AlertRule]:
    return AlertRule.objects.filter(team_id=team_id).select_related("project").order_by("name")


def recent_run_alerts(team_id: int, run_id: Any, limit: int = 20) -> list[Alert]:
    return list(alerts_for(team_id, run_id=run_id).order_by("-created_at")[:limit])
