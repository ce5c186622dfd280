"""Fixtures for environment tests: one sandbox engine (warm pools) shared by the session.

Code environments run completions in the real sandbox, which needs root and bubblewrap;
without them those tests are skipped with the reason."""

from __future__ import annotations

import atexit

import pytest

from tests.skips import sandbox_unavailable
from workers.envs.checkers import Sandbox

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
