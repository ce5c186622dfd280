"""Signals that apps low in the layering send after their commit, for apps above them to act
on without being imported (the alerts app evaluates its rules on them). Receivers must not
raise: a failing receiver is logged and skipped by ``send_robust``, never the ingest's error.
"""

from __future__ import annotations

from django.dispatch import Signal

#: A run's metric batch was stored (sent on commit). Arguments: ``run_id``, ``team_id``,
#: ``names`` (the set of metric names in the batch).
metric_batch_stored = Signal()

#: Events were appended to a run's log (sent on commit). Arguments: ``run_id``,
#: ``team_id``, ``events`` (a list of ``{"id", "kind", "level", "message", "data"}``).
run_events_appended = Signal()
