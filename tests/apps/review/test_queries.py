"""The review batches list costs the same queries for N batches as for 2N."""

from __future__ import annotations

import itertools

from apps.projects.models import Project
from tests.apps.queries import AssertMaxQueries, assert_rows_do_not_add_queries
from tests.apps.review.test_review import create
from tests.django_fixtures import Caller
from tests.factories import DatasetFactory

N = 3


def test_batches_list(member: Caller, project: Project,
                      django_assert_max_num_queries: AssertMaxQueries) -> None:
    DatasetFactory(project=project, team=project.team, slug="synth-math")
    seeds = itertools.count(1)

    def add() -> None:
        for seed in itertools.islice(seeds, N):
            r = create(member.client, sample_seed=seed)
            assert r.status_code == 201, r.content

    assert_rows_do_not_add_queries(member.client, "/api/v1/teams/acme/batches", add,
                                   django_assert_max_num_queries)
