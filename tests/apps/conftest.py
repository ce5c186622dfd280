"""The Django tests' fixtures (defined in tests/django_fixtures.py): the per-test isolation
that applies to every test here, and the team, project, caller and worker fixtures."""

from tests.django_fixtures import (  # noqa: F401 - pytest finds fixtures by name here
    admin,
    api,
    fast_password_hashing,
    isolated_cache,
    make_caller,
    member,
    object_store,
    other_team,
    outsider,
    owner,
    pool,
    project,
    qa,
    team,
    viewer,
    worker,
    worker_token,
    wsgi,
)
