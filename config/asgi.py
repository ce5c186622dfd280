"""ASGI entry point: HTTP through Django; websockets (live run streams) through Channels."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_asgi = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from apps.teams.ws_auth import TokenOrSessionAuth  # noqa: E402
from config.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": django_asgi,
        "websocket": TokenOrSessionAuth(URLRouter(websocket_urlpatterns)),
    }
)
