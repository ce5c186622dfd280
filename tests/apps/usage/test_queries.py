"""The team usage read costs the same queries for N runs as for 2N (runs that were never
interrupted; each interrupted attempt adds two reads for its last reported step)."""

from __future__ import annotations

import itertools

from apps.projects.models import Project
from apps.runs.models import Run, RunAttempt
from apps.scheduling.models import Allocation, Node
from tests.apps.queries import AssertMaxQueries, assert_rows_do_not_add_queries
from tests.apps.usage.world import H100, at
from tests.django_fixtures import Caller
from tests.factories import make_run

N = 3


def test_team_usage(member: Caller, project: Project, qa,
                    django_assert_max_num_queries: AssertMaxQueries) -> None:
    node = Node.objects.create(name="h100-a", pool="gpu", gpu_type="H100", gpu_count=8)
    names = itertools.count(1)

    def add() -> None:
        for i in itertools.islice(names, N):
            run = make_run(project, qa, name=f"r{i}")
            Run.objects.filter(pk=run.pk).update(status="succeeded", resources=H100,
                                                 created_at=at(0), finished_at=at(3600))
            RunAttempt.objects.create(run=run, number=1, outcome="succeeded",
                                      claimed_at=at(10), started_at=at(20),
                                      ended_at=at(3600), resume_step=0)
            Allocation.objects.create(run=run, node=node, gpu_ids=[0, 1], flavor="H100",
                                      created_at=at(0), released_at=at(3600))

    assert_rows_do_not_add_queries(
        member.client, "/api/v1/teams/acme/usage?from=2026-03-02&to=2026-03-03", add,
        django_assert_max_num_queries, count=lambda body: len(body["runs"]))
