"""The deployment tests read files (Dockerfiles, compose.yaml, the Kubernetes manifests) and
need neither Django nor a database, so they run with ``-p no:django`` and only once: in CI's
PostgreSQL pass (CRUCIBLE_DB_ONLY=1) they are skipped, as the engine tests are."""

from __future__ import annotations

import os

import pytest

from tests.skips import host_reason


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("CRUCIBLE_DB_ONLY") != "1":
        return
    skip = pytest.mark.skip(reason=host_reason("deployment files test: no database; ran in "
                                               "the embedded pass"))
    for item in items:
        if "/tests/deploy/" in str(item.fspath):
            item.add_marker(skip)
