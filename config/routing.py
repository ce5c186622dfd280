"""Websocket routes (filled in by the live-metrics work)."""

websocket_urlpatterns: list = []
