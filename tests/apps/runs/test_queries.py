"""The runs list and a run's checkpoints list cost the same queries for N rows as for 2N."""

from __future__ import annotations

import itertools

from apps.projects.models import Project
from apps.runs.models import Checkpoint, Run
from tests.apps.queries import AssertMaxQueries, assert_rows_do_not_add_queries
from tests.django_fixtures import Caller
from tests.factories import DatasetFactory, make_run, make_version

N = 3


def test_runs_list(member: Caller, project: Project,
                   django_assert_max_num_queries: AssertMaxQueries) -> None:
    dataset = DatasetFactory(project=project, team=project.team, slug="qa")
    make_version(dataset)

    def add() -> None:
        for _ in range(N):
            make_run(project, dataset)

    assert_rows_do_not_add_queries(member.client, "/api/v1/teams/acme/runs", add,
                                   django_assert_max_num_queries)


def test_checkpoints_of_a_run(member: Caller, project: Project,
                              django_assert_max_num_queries: AssertMaxQueries) -> None:
    run: Run = make_run(project)
    steps = itertools.count(1)

    def add() -> None:
        for step in itertools.islice(steps, N):
            Checkpoint.objects.create(run=run, team=project.team, step=step,
                                      uri=f"file:///x/{step}")

    assert_rows_do_not_add_queries(member.client,
                                   f"/api/v1/teams/acme/runs/{run.pk}/checkpoints", add,
                                   django_assert_max_num_queries)
