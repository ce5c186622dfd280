"""URLs for tests/apps/core/test_asgi_http.py: views that show where and how a request ran."""

from __future__ import annotations

import threading

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.core.cache import caches
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt


@csrf_exempt  # a POST from no browser session
def echo(request: HttpRequest) -> HttpResponse:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    response = JsonResponse({"thread": threading.current_thread().name,
                             "method": request.method, "body": request.body.decode(),
                             "query": request.GET.get("q", ""),
                             "path": request.path})
    response.set_cookie("seen", "yes")
    return response


def stream(request: HttpRequest) -> StreamingHttpResponse:
    return StreamingHttpResponse((f"part{i}\n".encode() for i in range(3)),
                                 content_type="text/plain")


def publish(request: HttpRequest) -> HttpResponse:
    """What a metric batch does on commit: a group message on the channel layer, from the
    request's (sync) thread."""
    async_to_sync(get_channel_layer().group_send)("asgi-test", {"type": "note", "n": 1})
    return HttpResponse("sent")


# The cache clients requests used, kept alive so no two can share an id().
CACHE_CLIENTS: list[object] = []


def cache_client(request: HttpRequest) -> HttpResponse:
    """The client the default cache gives this request (building one does not connect)."""
    CACHE_CLIENTS.append(caches["default"]._cache)  # type: ignore[attr-defined]
    return HttpResponse("ok")


def boom(request: HttpRequest) -> HttpResponse:
    raise RuntimeError("view failed")


urlpatterns = [
    path("echo", echo),
    path("stream", stream),
    path("publish", publish),
    path("boom", boom),
    path("cache-client", cache_client),
]
