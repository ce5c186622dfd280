"""Websocket routes."""

from django.urls import re_path

from apps.runs.consumers import RunStreamConsumer, TeamRunsConsumer

websocket_urlpatterns = [
    re_path(r"^ws/teams/(?P<team>[-a-zA-Z0-9_]+)/runs/(?P<run>[0-9a-fA-F-]+)/stream$",
            RunStreamConsumer.as_asgi()),
    re_path(r"^ws/teams/(?P<team>[-a-zA-Z0-9_]+)/runs$", TeamRunsConsumer.as_asgi()),
]
