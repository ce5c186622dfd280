"""Publish live events to the channel layer once the writing transaction commits.

Consumers (websockets) subscribe to these groups; nothing is sent for a rolled-back write.
"""

from __future__ import annotations

import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

log = logging.getLogger(__name__)


def run_group(run_id: object) -> str:
    return f"run.{run_id}"


def team_group(team_id: int) -> str:
    return f"team.{team_id}"


def _send(group: str, payload: dict[str, Any]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(group, {"type": "crucible.event", "payload": payload})
    except Exception:  # a live-update hiccup must never fail a committed write
        log.warning("could not publish %s to %s", payload.get("type"), group, exc_info=True)


def publish_on_commit(group: str, payload: dict[str, Any]) -> None:
    transaction.on_commit(lambda: _send(group, payload))
