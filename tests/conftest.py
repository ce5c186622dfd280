"""Shared fixtures: users with roles in a team, token-authenticated API clients, and an
isolated object store per test."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from rest_framework.test import APIClient

from apps.core.actor import Actor
from apps.core.storage import store
from apps.teams.models import Role, Team
from apps.teams.services import personal_token_create, worker_token_create
from tests.factories import MembershipFactory, ProjectFactory, TeamFactory, UserFactory

# Under CI=true a skip for a missing installable dependency fails the run (tests/skips.py).
pytest_plugins = ["tests.skips"]


@pytest.fixture(autouse=True)
def object_store(tmp_path, settings):
    """Each test gets its own object store folder."""
    folder = tmp_path / "objects"
    settings.OBJECT_STORE_URL = folder.as_uri()
    store.cache_clear()
    yield store()
    store.cache_clear()


@pytest.fixture(autouse=True)
def isolated_cache(settings):
    """Each test gets its own cache namespace, so one test's rate-limit counters (every
    test client calls from 127.0.0.1) never throttle the next. Keys expire by themselves;
    nothing is flushed (on Redis the database is shared with the broker)."""
    import uuid

    default = settings.CACHES["default"]
    settings.CACHES = {**settings.CACHES,
                       "default": {**default, "KEY_PREFIX": f"test-{uuid.uuid4().hex[:12]}"}}


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    """Users are made per test; the production hasher costs ~1 s each on a shared CPU."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@dataclass
class Caller:
    user: object
    token: str
    client: APIClient


def client_for_token(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


@pytest.fixture
def make_caller(db) -> Callable[..., Caller]:
    def make(team: Team | None = None, role: str = Role.MEMBER, username: str | None = None):
        user = UserFactory(**({"username": username} if username else {}))
        if team is not None:
            MembershipFactory(team=team, user=user, role=role)
        _, raw = personal_token_create(actor=Actor.of_user(user), user=user, name="test")
        return Caller(user, raw, client_for_token(raw))

    return make


@pytest.fixture
def team(db) -> Team:
    return TeamFactory(slug="acme")


@pytest.fixture
def other_team(db) -> Team:
    return TeamFactory(slug="rival")


@pytest.fixture
def project(team):
    return ProjectFactory(team=team, slug="main")


@pytest.fixture
def owner(make_caller, team) -> Caller:
    return make_caller(team, Role.OWNER, "olivia")


@pytest.fixture
def admin(make_caller, team) -> Caller:
    return make_caller(team, Role.ADMIN, "adam")


@pytest.fixture
def member(make_caller, team) -> Caller:
    return make_caller(team, Role.MEMBER, "mia")


@pytest.fixture
def viewer(make_caller, team) -> Caller:
    return make_caller(team, Role.VIEWER, "victor")


@pytest.fixture
def outsider(make_caller, other_team) -> Caller:
    """A member of another team: must see 404 on every URL of ``team``."""
    return make_caller(other_team, Role.OWNER, "oscar")


@pytest.fixture
def worker_token(db) -> str:
    _, raw = worker_token_create(actor=Actor.system(), team=None, name="pool")
    return raw


@pytest.fixture
def worker(worker_token) -> APIClient:
    return client_for_token(worker_token)


def pytest_collection_modifyitems(config, items):
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

