"""Websockets: one live stream per run, and one per team for its runs table.

Run stream protocol (JSON messages, server → client):
``{"type": "event"|"metrics", "seq": n, ...}`` with n increasing by exactly 1. Connect with
``?after=<last seq seen>`` to receive what was missed first; no gaps, no duplicates. The
consumer joins the channel group before replaying, drops live messages it already sent,
and goes back to the database when a live message skips ahead or announces a large metric
batch without its points (a summary: the client always gets the points).
"""

from __future__ import annotations

import uuid
from typing import Any
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from apps.core import jsonsafe
from apps.core.events import run_group, team_group
from apps.core.exceptions import NotFound
from apps.runs.models import Run
from apps.runs.stream import messages_after
from apps.teams.access import access_team

CLOSE_NOT_FOUND = 4404
CLOSE_UNSUPPORTED_DATA = 1003  # RFC 6455: a binary frame where only text is accepted
CLOSE_INVALID_PAYLOAD = 1007  # RFC 6455: text that is not what the endpoint accepts


class JsonFramesConsumer(AsyncJsonWebsocketConsumer):
    """Text frames of JSON only. Anything else gets an error message naming the problem and
    a close frame with the RFC 6455 code for it, instead of an exception that drops the
    connection without one."""

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None,
                      **kwargs: Any) -> None:
        if text_data is None:
            await self._refuse(CLOSE_UNSUPPORTED_DATA, "binary_frame",
                               "This stream accepts JSON text frames only, e.g. "
                               '{"type": "ping"}; a binary frame is not accepted.')
            return
        try:
            content = jsonsafe.loads(text_data)
        except jsonsafe.InvalidJSON as exc:
            await self._refuse(CLOSE_INVALID_PAYLOAD, "invalid_json",
                               f"Frames must be JSON text, e.g. {{\"type\": \"ping\"}}: {exc}")
            return
        await self.receive_json(content, **kwargs)

    async def _refuse(self, code: int, error: str, message: str) -> None:
        await self.send_json({"type": "error", "code": error, "message": message[:500]})
        await self.close(code=code)


def _membership_team_id(user: Any, team_slug: str) -> int | None:
    """The team's id if ``user`` is a member (the pages' and the API's ``access_team``)."""
    try:
        team, _ = access_team(user, team_slug)
    except NotFound:
        return None
    return team.pk


class RunStreamConsumer(JsonFramesConsumer):
    async def connect(self) -> None:
        kwargs = self.scope["url_route"]["kwargs"]
        self.run_id = await database_sync_to_async(self._authorize)(kwargs["team"], kwargs["run"])
        if self.run_id is None:
            await self.close(code=CLOSE_NOT_FOUND)  # non-members: same as "no such run"
            return
        query = parse_qs(self.scope.get("query_string", b"").decode())
        try:
            self.last_seq = max(0, int(query.get("after", ["0"])[0]))
        except ValueError:
            self.last_seq = 0
        self.group = run_group(self.run_id)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        await self._catch_up()

    def _authorize(self, team: str, run: str) -> uuid.UUID | None:
        team_id = _membership_team_id(self.scope.get("user"), team)
        if team_id is None:
            return None
        try:
            run_id = uuid.UUID(run)
        except ValueError:
            return None
        return run_id if Run.objects.filter(pk=run_id, team_id=team_id).exists() else None

    async def disconnect(self, code: int) -> None:
        if getattr(self, "group", None):
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def _catch_up(self) -> None:
        while True:
            batch = await database_sync_to_async(messages_after)(self.run_id, self.last_seq)
            for message in batch:
                await self.send_json(message)
                self.last_seq = message["seq"]
            if len(batch) < 500:
                return

    async def crucible_event(self, message: dict[str, Any]) -> None:
        payload = message["payload"]
        seq = payload.get("seq")
        if seq is None or seq <= self.last_seq:
            return  # already sent during a replay
        if seq == self.last_seq + 1 and not payload.get("summary"):
            await self.send_json(payload)
            self.last_seq = seq
            return
        # We skipped ahead (fill the hole from the database), or a large metric batch was
        # announced without its points (``apps.metrics.services.INLINE_POINTS``): read it.
        await self._catch_up()

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        """Clients only listen; a ping gets the current position back."""
        if isinstance(content, dict) and content.get("type") == "ping":
            await self.send_json({"type": "pong", "last_seq": self.last_seq})


class TeamRunsConsumer(JsonFramesConsumer):
    """Status changes of a team's runs, for the live runs table (no replay: the page
    reloads the table on reconnect)."""

    async def connect(self) -> None:
        slug = self.scope["url_route"]["kwargs"]["team"]
        team_id = await database_sync_to_async(_membership_team_id)(self.scope.get("user"), slug)
        if team_id is None:
            await self.close(code=CLOSE_NOT_FOUND)
            return
        self.group = team_group(team_id)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        if getattr(self, "group", None):
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def crucible_event(self, message: dict[str, Any]) -> None:
        await self.send_json(message["payload"])
