"""Fixtures for environment tests: one sandbox engine (warm pools) shared by the session.

Code environments run completions in the real sandbox, which needs root and bubblewrap;
without them those tests are skipped with the reason."""

from __future__ import annotations

import atexit
import os
import shutil

import pytest

from workers.envs.checkers import Sandbox


def sandbox_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the sandbox engine runs as root (cgroups, dropping to the sandbox uid)"
    if not shutil.which("bwrap"):
        return "bubblewrap missing: run scripts/install_sandbox_deps.sh (apt: bubblewrap)"
    from workers.sandbox import cgroups

    try:
        cgroups.backend()
    except cgroups.CgroupError as exc:
        return str(exc)
    return None


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
