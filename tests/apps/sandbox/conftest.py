"""Fixtures for the sessions API tests (the session host itself: tests/apps/sandbox/served.py)."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def hosted(host: tuple[str, str], settings: Any) -> None:
    """Point the API at the module's session host (`host`, a fixture of each test module)."""
    settings.CRUCIBLE = {**settings.CRUCIBLE, "SESSION_HOST_URL": host[0],
                         "SESSION_HOST_TOKEN": host[1]}
