"""Fixtures for the sandbox engine's tests: one engine (with warm pools) for the whole session.

The engine needs root (cgroups, dropping to the sandbox uid) and bubblewrap; without them every
sandbox test is skipped with the reason, and `scripts/install_sandbox_deps.sh` installs the rest.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator

import pytest

from workers.sandbox import Engine, EngineConfig, ExecutionRequest, ExecutionResult, cgroups


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the sandbox engine runs as root (cgroups, dropping to the sandbox uid)"
    if not shutil.which("bwrap"):
        return "bubblewrap missing: run scripts/install_sandbox_deps.sh (apt: bubblewrap)"
    try:
        cgroups.backend()
    except cgroups.CgroupError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    with Engine(EngineConfig(pool_size=1)) as eng:
        yield eng


@pytest.fixture
def run(engine: Engine) -> Callable[..., ExecutionResult]:
    """run(language, code, **request_fields) -> ExecutionResult"""

    def _run(language: str, code: str, **fields: object) -> ExecutionResult:
        return engine.execute(ExecutionRequest(language=language, code=code, **fields))

    return _run
