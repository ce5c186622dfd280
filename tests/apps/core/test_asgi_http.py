"""ThreadedHTTPHandler (apps/core/asgi_http.py): Django's sync request path under ASGI, one
thread hop a request. Driven in-process through the ASGI interface, as uvicorn calls it."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from channels.layers import get_channel_layer
from django.core.signals import request_finished, request_started
from django.test import override_settings

from apps.core.asgi_http import ThreadedHTTPHandler

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.urls("tests.apps.core.asgi_urls")]


async def call(app: Any, method: str, path: str, body: bytes = b"",
               query: bytes = b"") -> tuple[int, dict[bytes, list[bytes]], list[dict]]:
    """One request through ``app``; (status, headers, the body messages)."""
    chunks = [{"type": "http.request", "body": body[:3], "more_body": True},
              {"type": "http.request", "body": body[3:], "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        if chunks:
            return chunks.pop(0)
        await asyncio.Event().wait()  # no disconnect: the client waits for its answer
        return {}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": query, "root_path": "",
             "headers": [(b"host", b"testserver"), (b"content-type", b"text/plain"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 5000), "server": ("testserver", 80)}
    await asyncio.wait_for(app(scope, receive, send), timeout=30)
    start, *bodies = sent
    assert start["type"] == "http.response.start"
    headers: dict[bytes, list[bytes]] = {}
    for name, value in start["headers"]:
        headers.setdefault(name.lower(), []).append(value)
    return start["status"], headers, bodies


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture
def handler():
    """ThreadedHTTPHandler(threads), its pool threads' connections closed afterwards (they
    persist between requests; an open one would keep the test database from being dropped)."""
    made: list[ThreadedHTTPHandler] = []

    def make(threads: int) -> ThreadedHTTPHandler:
        made.append(ThreadedHTTPHandler(threads=threads))
        return made[-1]

    yield make
    for app in made:
        app.close_connections()
        app.executor.shutdown()


def test_a_request_runs_in_one_pool_thread_with_body_query_and_cookies(handler):
    app = handler(2)
    started: list[str] = []
    finished: list[str] = []

    def on_start(**kwargs: Any) -> None:
        started.append(threading.current_thread().name)

    def on_finish(**kwargs: Any) -> None:
        finished.append(threading.current_thread().name)

    request_started.connect(on_start)
    request_finished.connect(on_finish)
    try:
        status, headers, bodies = run(call(app, "POST", "/echo", body=b"hello world",
                                           query=b"q=%C3%A9t%C3%A9"))
    finally:
        request_started.disconnect(on_start)
        request_finished.disconnect(on_finish)
    assert status == 200
    import json
    answer = json.loads(b"".join(m["body"] for m in bodies))
    assert answer == {"thread": answer["thread"], "method": "POST", "body": "hello world",
                      "query": "été", "path": "/echo"}
    assert answer["thread"].startswith("crucible-http")
    # The signals that hand database connections back run in the thread that used them.
    assert started == [answer["thread"]] and finished == [answer["thread"]]
    assert headers[b"content-type"] == [b"application/json"]
    assert any(c.startswith(b"seen=yes") for c in headers[b"set-cookie"])
    assert bodies[-1].get("more_body", False) is False


def test_a_streaming_response_arrives_in_order_and_ends(handler):
    app = handler(1)
    status, headers, bodies = run(call(app, "GET", "/stream"))
    assert status == 200
    assert b"".join(m["body"] for m in bodies if "body" in m) == b"part0\npart1\npart2\n"
    assert all(m["more_body"] for m in bodies[:-1]) and not bodies[-1].get("more_body")


def test_a_failing_view_is_a_500_and_the_next_request_is_served(handler):
    app = handler(1)
    with override_settings(DEBUG=False):
        status, _, _ = run(call(app, "GET", "/boom"))
        assert status == 500
        status, _, bodies = run(call(app, "GET", "/echo"))
    assert status == 200


@override_settings(CHANNEL_LAYERS={"default": {
    "BACKEND": "channels.layers.InMemoryChannelLayer"}})
def test_a_channel_layer_publish_from_the_view_reaches_the_servers_loop(handler):
    """events.publish (metric batches, run events) calls async_to_sync from the request's
    thread: the message must land on the event loop that serves the websockets."""
    app = handler(2)

    async def scenario() -> dict:
        layer = get_channel_layer()
        channel = await layer.new_channel()
        await layer.group_add("asgi-test", channel)
        status, _, bodies = await call(app, "GET", "/publish")
        assert status == 200 and bodies[0]["body"] == b"sent"
        return await asyncio.wait_for(layer.receive(channel), timeout=10)

    assert run(scenario()) == {"type": "note", "n": 1}


def test_concurrent_requests_share_the_pool_threads(handler):
    app = handler(2)

    async def scenario() -> list[int]:
        results = await asyncio.gather(*(call(app, "GET", "/echo") for _ in range(8)))
        return [status for status, _, _ in results]

    assert run(scenario()) == [200] * 8
    assert len(app.executor._threads) <= 2


def test_threads_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        ThreadedHTTPHandler(threads=0)


def test_the_asgi_application_serves_http_through_the_threaded_handler():
    from config import asgi

    assert isinstance(asgi.django_http, ThreadedHTTPHandler)
    try:
        with override_settings(ROOT_URLCONF="config.urls"):
            status, _, bodies = run(call(asgi.application, "GET", "/healthz"))
    finally:
        asgi.django_http.close_connections()
    assert status == 200, bodies
