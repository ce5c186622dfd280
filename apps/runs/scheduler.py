"""Whether the admission loop decides where runs start (``CRUCIBLE_SCHEDULER``). Off, a
launch dispatches at once and any worker of the pool may claim; on, a run is dispatched and
claimable only once a pass gave it an allocation."""

from __future__ import annotations

from django.conf import settings


def enabled() -> bool:
    return bool(settings.CRUCIBLE.get("SCHEDULER", False))
