"""ASGI entry point: HTTP through Django (its sync request path in a thread pool, one thread
hop a request: apps/core/asgi_http.py); websockets (live run streams) through Channels."""

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django.setup(set_prefix=False)

from django.conf import settings  # noqa: E402
from django.core.handlers.asgi import ASGIHandler  # noqa: E402

from apps.core.asgi_http import ThreadedHTTPHandler  # noqa: E402

# CRUCIBLE_HTTP_THREADS=0: Django's own async handler (the behaviour before; for comparison).
django_http = ThreadedHTTPHandler(settings.CRUCIBLE["HTTP_THREADS"]) \
    if settings.CRUCIBLE["HTTP_THREADS"] > 0 else ASGIHandler()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from apps.teams.ws_auth import TokenOrSessionAuth  # noqa: E402
from config.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": django_http,
        "websocket": TokenOrSessionAuth(URLRouter(websocket_urlpatterns)),
    }
)
