"""Fixtures for the sandbox engine's tests: one engine (with warm pools) for the whole session.

The engine needs root (cgroups, dropping to the sandbox uid) and bubblewrap; without them every
sandbox test is skipped with the reason, and `scripts/install_sandbox_deps.sh` installs the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.skips import sandbox_unavailable
from workers.sandbox import Engine, EngineConfig, ExecutionRequest, ExecutionResult


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    reason = sandbox_unavailable()  # root and cgroups: host skips; bubblewrap: installable
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
