"""A real session host (real sandboxes) over real HTTP, for the sessions API tests."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.skips import sandbox_unavailable


@contextmanager
def serve_sessions(**manager_options: Any) -> Iterator[tuple[str, str]]:
    """A session host on a free port over its own SessionManager: (its URL, its token);
    skips the test where the host cannot run sandboxes."""
    reason = sandbox_unavailable()
    if reason:
        pytest.skip(reason)
    from workers.sandbox import session_host, sessions  # noqa: PLC0415 - engine only here

    token = secrets.token_hex(16)
    with sessions.SessionManager(**manager_options) as manager:
        server = session_host.serve(session_host.SessionHost(manager, token), ("127.0.0.1", 0))
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}", token
        finally:
            server.shutdown()
            server.server_close()
