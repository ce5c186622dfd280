"""Fixtures for the tests that load Django: users with roles in a team, token-authenticated
API clients, and per-test isolation of the object store, cache and password hashing.

Kept out of tests/conftest.py so the engine tests (tests/workers) never import Django or DRF:
tests/apps, tests/e2e and tests/browser pull these in through their own conftest.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from apps.core.actor import Actor
from apps.core.storage import store
from apps.projects.models import Project
from apps.teams.models import Role, Team
from apps.teams.services import personal_token_create, worker_token_create
from tests.factories import MembershipFactory, ProjectFactory, TeamFactory, UserFactory
from workers.storage import LocalStore, S3Store


@pytest.fixture(autouse=True)
def object_store(tmp_path: Path, settings: Any) -> Iterator[LocalStore | S3Store]:
    """Each test gets its own object store folder."""
    folder = tmp_path / "objects"
    settings.OBJECT_STORE_URL = folder.as_uri()
    store.cache_clear()
    yield store()
    store.cache_clear()


@pytest.fixture(autouse=True)
def isolated_cache(settings: Any) -> None:
    """Each test gets its own cache namespace, so one test's rate-limit counters (every
    test client calls from 127.0.0.1) never throttle the next. Keys expire by themselves;
    nothing is flushed (on Redis the database is shared with the broker)."""
    import uuid

    default = settings.CACHES["default"]
    settings.CACHES = {**settings.CACHES,
                       "default": {**default, "KEY_PREFIX": f"test-{uuid.uuid4().hex[:12]}"}}


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    """Users are made per test; the production hasher costs ~1 s each on a shared CPU."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@dataclass
class Caller:
    """A user, their raw API token, and a client that sends it."""

    user: Any
    token: str
    client: APIClient


def client_for_token(token: str) -> APIClient:
    """An API client authenticated by ``token`` (a personal or worker token)."""
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


@pytest.fixture
def make_caller(db: None) -> Callable[..., Caller]:
    def make(team: Team | None = None, role: str = Role.MEMBER,
             username: str | None = None) -> Caller:
        user = UserFactory(**({"username": username} if username else {}))
        if team is not None:
            MembershipFactory(team=team, user=user, role=role)
        _, raw = personal_token_create(actor=Actor.of_user(user), user=user, name="test")
        return Caller(user, raw, client_for_token(raw))

    return make


@pytest.fixture
def team(db: None) -> Team:
    return TeamFactory(slug="acme")


@pytest.fixture
def other_team(db: None) -> Team:
    return TeamFactory(slug="rival")


@pytest.fixture
def project(team: Team) -> Project:
    return ProjectFactory(team=team, slug="main")


@pytest.fixture
def owner(make_caller: Callable[..., Caller], team: Team) -> Caller:
    return make_caller(team, Role.OWNER, "olivia")


@pytest.fixture
def admin(make_caller: Callable[..., Caller], team: Team) -> Caller:
    return make_caller(team, Role.ADMIN, "adam")


@pytest.fixture
def member(make_caller: Callable[..., Caller], team: Team) -> Caller:
    return make_caller(team, Role.MEMBER, "mia")


@pytest.fixture
def viewer(make_caller: Callable[..., Caller], team: Team) -> Caller:
    return make_caller(team, Role.VIEWER, "victor")


@pytest.fixture
def outsider(make_caller: Callable[..., Caller], other_team: Team) -> Caller:
    """A member of another team: must see 404 on every URL of ``team``."""
    return make_caller(other_team, Role.OWNER, "oscar")


@pytest.fixture
def worker_token(db: None) -> str:
    _, raw = worker_token_create(actor=Actor.system(), team=None, name="pool")
    return raw


@pytest.fixture
def worker(worker_token: str) -> APIClient:
    return client_for_token(worker_token)


@pytest.fixture
def wsgi(db: None) -> Iterator[Any]:
    """The Django WSGI app as an httpx transport, sharing the test's transaction: the request
    signals must not close the connection around each request (which would end it). Django's
    test client would reconnect them, so the SDK tests use this instead."""
    import httpx
    from django.core.signals import request_finished, request_started
    from django.core.wsgi import get_wsgi_application
    from django.db import close_old_connections

    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield httpx.WSGITransport(app=get_wsgi_application())
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


@pytest.fixture
def pool(wsgi: Any, worker_token: str) -> Iterator[Any]:
    """The worker pools' client (a worker token), in-process."""
    from workers.client import CrucibleClient

    with CrucibleClient("http://testserver", worker_token, transport=wsgi, retries=0) as c:
        yield c


@pytest.fixture
def qa(project: Project) -> Any:
    """Dataset "qa" in the team's project, with one version of the factory's records."""
    from tests.factories import DatasetFactory, make_version

    dataset = DatasetFactory(project=project, team=project.team, slug="qa")
    make_version(dataset)
    dataset.refresh_from_db()
    return dataset


@pytest.fixture
def api(wsgi: Any, member: Caller) -> Iterator[Any]:
    """The SDK client (`workers.client.CrucibleClient`) as the member, over `wsgi`."""
    from workers.client import CrucibleClient

    with CrucibleClient("http://testserver", member.token, transport=wsgi, retries=0) as c:
        yield c
