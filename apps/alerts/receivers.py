"""Signal receivers: the hooks by which metric ingest and run events reach the rules
(connected in AlertsConfig.ready). No logic here; the services evaluate."""

from __future__ import annotations

from typing import Any

from django.dispatch import receiver

from apps.alerts import services
from apps.core import signals


@receiver(signals.metric_batch_stored, dispatch_uid="alerts.metrics")
def metrics_stored(sender: Any, *, run_id: Any, team_id: int, names: set[str],
                   **_: Any) -> None:
    services.on_metrics(run_id=run_id, team_id=team_id, names=names)


@receiver(signals.run_events_appended, dispatch_uid="alerts.events")
def events_appended(sender: Any, *, run_id: Any, team_id: int, events: list[dict[str, Any]],
                    **_: Any) -> None:
    services.on_events(run_id=run_id, team_id=team_id, events=events)
