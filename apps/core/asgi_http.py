"""HTTP under ASGI with Django's middleware and views run synchronously, one thread hop a request.

Django's own ``ASGIHandler`` runs the middleware chain in async mode: every middleware built
on ``MiddlewareMixin`` (all of Django's, whitenoise, csp, axes...) crosses from the event loop
to a thread and back for its ``process_request`` and again for its ``process_response``, the
sync view is one more crossing, and each request gets a new thread of its own. cProfile of
``GET /healthz`` through it (in-process, no server) counted 17 ``run_in_executor`` calls, 27
lock waits and 2 thread starts a request: 2.3-2.8 ms of CPU for a ``SELECT 1``, and on a
loaded machine every crossing is a thread wake-up that waits for a core, which is how a
trivial GET took tens of milliseconds there. (The per-request thread also defeated Django's
persistent connections: each request's connection was left to the garbage collector.)

:class:`ThreadedHTTPHandler` keeps Django's request class, signals and response encoding but
builds the middleware chain in sync mode (as under WSGI, which is also what Django's test
client runs) and hands the whole request to a bounded thread pool in one crossing: the body is
read on the event loop, the request runs start to finish in one pool thread, and a plain
response is closed there (``request_finished``: the thread's database connection goes back)
before the loop sends it. A streaming response is iterated in the pool thread, each chunk sent
through the loop. Pool threads are reused, so each keeps its database connection
(``CONN_MAX_AGE``) or returns it to the pool (``DATABASE_POOL_SIZE``).

What Django's async handler did and this does not: cancel a view when the client disconnects
mid-request (views here are short; a streaming response stops at the next chunk's send), and
run more than ``threads`` requests of one process at once (more wait for a free thread, as
under a threaded WSGI server).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import IO, Any

from asgiref.sync import async_to_sync, sync_to_async
from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.handlers.base import BaseHandler
from django.db import connections
from django.http import FileResponse, HttpResponseBase
from django.urls import set_script_prefix

log = logging.getLogger(__name__)

Send = Any  # the ASGI send callable


class ThreadedHTTPHandler(ASGIHandler):
    """An ASGI application for ``http`` scopes: Django's sync request path in a thread pool."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1; got {threads}")
        BaseHandler.__init__(self)  # not ASGIHandler's: it builds the chain in async mode
        self.load_middleware(is_async=False)
        self.threads = threads
        self.executor = ThreadPoolExecutor(max_workers=threads,
                                           thread_name_prefix="crucible-http")
        self._respond_async = sync_to_async(self._respond, thread_sensitive=False,
                                            executor=self.executor)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Send) -> None:
        if scope["type"] != "http":
            raise ValueError(f"ThreadedHTTPHandler serves http scopes only, not {scope['type']}")
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        try:
            response = await self._respond_async(scope, body_file, send)
        finally:
            body_file.close()
        if response is not None:
            await self.send_response(response, send)

    def _respond(self, scope: dict[str, Any], body_file: IO[bytes],
                 send: Send) -> HttpResponseBase | None:
        """Run in a pool thread: the request start to finish. Returns a plain response,
        already closed, for the loop to send; None once a streaming one is sent."""
        set_script_prefix(get_script_prefix(scope))
        signals.request_started.send(sender=self.__class__, scope=scope)
        request, response = self.create_request(scope, body_file)
        if request is not None:
            response = self.get_response(request)
            response._handler_class = self.__class__  # type: ignore[attr-defined]
            if isinstance(response, FileResponse):
                response.block_size = self.chunk_size
        assert response is not None
        if not response.streaming:
            response.close()
            return response
        try:
            self._send_streaming(response, async_to_sync(send))
        finally:
            response.close()
        return None

    def close_connections(self, timeout: float = 10.0) -> None:
        """Close the database connections every pool thread holds (they persist between
        requests under ``CONN_MAX_AGE``), e.g. before a test database is dropped. One job per
        live thread, held at a barrier until all have run, so each thread takes exactly one."""
        alive = len(self.executor._threads)
        if not alive:
            return
        barrier = threading.Barrier(alive)

        def close() -> None:
            connections.close_all()
            barrier.wait(timeout)

        wait([self.executor.submit(close) for _ in range(alive)], timeout=timeout)

    def _send_streaming(self, response: HttpResponseBase, send: Any) -> None:
        send({"type": "http.response.start", "status": response.status_code,
              "headers": self._headers(response)})
        for part in response:
            for chunk, _ in self.chunk_bytes(part):
                send({"type": "http.response.body", "body": chunk, "more_body": True})
        send({"type": "http.response.body"})

    @staticmethod
    def _headers(response: HttpResponseBase) -> list[tuple[bytes, bytes]]:
        """Response headers and cookies as ASGI wants them (as Django's send_response)."""
        headers = []
        for header, value in response.items():
            headers.append((header.encode("ascii") if isinstance(header, str) else header,
                            value.encode("latin1") if isinstance(value, str) else value))
        for cookie in response.cookies.values():
            headers.append((b"Set-Cookie", cookie.output(header="").encode("ascii").strip()))
        return headers
