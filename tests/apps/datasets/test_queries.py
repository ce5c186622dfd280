"""The datasets list costs the same queries for N datasets (each with a version) as for 2N."""

from __future__ import annotations

import itertools

from apps.projects.models import Project
from tests.apps.queries import AssertMaxQueries, assert_rows_do_not_add_queries
from tests.django_fixtures import Caller
from tests.factories import DatasetFactory, make_version

N = 3


def test_datasets_list(member: Caller, project: Project,
                       django_assert_max_num_queries: AssertMaxQueries) -> None:
    numbers = itertools.count()

    def add() -> None:
        for i in itertools.islice(numbers, N):
            dataset = DatasetFactory(project=project, team=project.team, slug=f"d{i}")
            make_version(dataset, [{"prompt": f"q{i}", "answer": str(i)}])

    assert_rows_do_not_add_queries(member.client, "/api/v1/teams/acme/datasets", add,
                                   django_assert_max_num_queries)
