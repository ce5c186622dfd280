"""A sandbox engine for the code-task tests (skipped with the reason where it cannot run)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.skips import sandbox_unavailable
from workers.sandbox import Engine, EngineConfig


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    reason = sandbox_unavailable()
    if reason:
        pytest.skip(reason)
    with Engine(EngineConfig(pool_size=1, warm_languages=("python",))) as eng:
        yield eng
