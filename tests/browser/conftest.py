"""A real ASGI server (uvicorn, in a thread of the test process so it shares the test
database and channel layer) and Debian's chromium driven by Playwright."""

from __future__ import annotations

import shutil
import socket
import threading
import time

import pytest

# Each test's own object store, cache namespace and fast hasher, as in tests/apps.
from tests.django_fixtures import (  # noqa: F401 - autouse fixtures, found by name
    fast_password_hashing,
    isolated_cache,
    object_store,
)

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def asgi_server(transactional_db):
    import uvicorn

    from config.asgi import application

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(application, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
    from config.asgi import django_http

    if hasattr(django_http, "close_connections"):  # its pool threads' connections
        django_http.close_connections()


@pytest.fixture
def browser(monkeypatch):
    # Playwright's sync API keeps an event loop in the test's thread; Django refuses ORM
    # calls there unless told the test knows what it is doing.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    if not shutil.which(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium; "
                    ".ci/run installs it)")
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()
