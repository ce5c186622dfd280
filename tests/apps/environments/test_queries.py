"""The environments list costs the same queries for N environments (each with a version) as
for 2N."""

from __future__ import annotations

import itertools

from apps.core.actor import Actor
from apps.environments import services
from apps.projects.models import Project
from tests.apps.queries import AssertMaxQueries, assert_rows_do_not_add_queries
from tests.django_fixtures import Caller

N = 3


def test_environments_list(member: Caller, project: Project,
                           django_assert_max_num_queries: AssertMaxQueries) -> None:
    numbers = itertools.count()

    def add() -> None:
        for i in itertools.islice(numbers, N):
            env = services.environment_create(actor=Actor.system(), team=project.team,
                                              project=project, slug=f"env{i}")
            services.version_create(actor=Actor.system(), environment=env,
                                    spec={"task": f"t{i}"})

    assert_rows_do_not_add_queries(member.client, "/api/v1/teams/acme/environments", add,
                                   django_assert_max_num_queries)
