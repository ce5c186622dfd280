"""Fixtures for environment tests: one sandbox engine (warm pools) shared by the session.

Code environments run completions in the real sandbox, which needs root and bubblewrap;
without them those tests are skipped with the reason."""

from __future__ import annotations

import atexit
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from tests.skips import sandbox_unavailable
from workers.envs.checkers import Sandbox

if TYPE_CHECKING:
    from workers.sandbox.sessions import SessionManager

# Terminal-Bench task fixtures: their tests/ are data for the importer, not tests of this suite.
collect_ignore = ["terminal_bench"]

_shared: Sandbox | None = None


def shared_sandbox() -> Sandbox:
    """One engine for the envs and qc test packages alike (both conftests use it)."""
    global _shared
    if _shared is None:
        from workers.sandbox import Engine, EngineConfig

        engine = Engine(EngineConfig(pool_size=4))
        atexit.register(engine.close)
        engine.warm_up("python")
        _shared = Sandbox(engine, concurrency=4)
    return _shared


@pytest.fixture(scope="session")
def sandbox() -> Sandbox:
    reason = sandbox_unavailable()
    if reason:
        pytest.skip(reason)
    return shared_sandbox()


@pytest.fixture(scope="module")
def manager() -> Iterator[SessionManager]:
    """A session manager per test module (terminal tasks, their play); skips without sandbox."""
    reason = sandbox_unavailable()
    if reason:
        pytest.skip(reason)
    from workers.sandbox.sessions import SessionManager

    with SessionManager(watch_every_s=0.1) as mgr:
        yield mgr
