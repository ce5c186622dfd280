"""Root conftest: only what every test needs, and nothing that imports Django, so the engine
tests (tests/workers) run with ``-p no:django``. The Django fixtures live in
tests/django_fixtures.py, pulled in by the conftest of each Django test folder."""

from __future__ import annotations

import pytest

# Under CI=true a skip for a missing installable dependency fails the run (tests/skips.py).
pytest_plugins = ["tests.skips"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With CRUCIBLE_DB_ONLY=1 (CI's PostgreSQL pass) skip engine tests: they use no
    database or broker, so the embedded pass already covered them."""
    import os

    from tests.skips import host_reason

    if os.environ.get("CRUCIBLE_DB_ONLY") != "1":
        return
    skip = pytest.mark.skip(reason=host_reason("engine test: no database; ran in the "
                                               "embedded pass"))
    for item in items:
        if "/tests/workers/" in str(item.fspath) and "test_storage" not in str(item.fspath):
            item.add_marker(skip)
