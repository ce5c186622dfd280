"""A run's metrics read costs the same queries for N points per series as for 2N (the
downsampling happens in the database, not by loading points)."""

from __future__ import annotations

import itertools
from typing import Any

from apps.metrics.models import MetricPoint, MetricSeries
from apps.projects.models import Project
from tests.apps.queries import AssertMaxQueries, assert_rows_do_not_add_queries
from tests.django_fixtures import Caller
from tests.factories import make_run

N = 3
NAMES = ("loss", "reward")


def points(body: dict[str, Any]) -> int:
    """All the points the response holds, over every series."""
    return sum(len(series["points"]) for series in body["series"])


def test_metrics_of_a_run(member: Caller, project: Project,
                          django_assert_max_num_queries: AssertMaxQueries) -> None:
    run = make_run(project)
    steps = itertools.count()

    def add() -> None:
        batch = list(itertools.islice(steps, N))
        MetricPoint.objects.bulk_create(
            MetricPoint(run=run, name=name, step=step, value=float(step),
                        wall_time=1.7e9 + step)
            for name in NAMES for step in batch)
        for name in NAMES:
            MetricSeries.objects.update_or_create(
                run=run, name=name, defaults={"count": batch[-1] + 1, "first_step": 0,
                                              "last_step": batch[-1]})

    assert_rows_do_not_add_queries(member.client, f"/api/v1/teams/acme/runs/{run.pk}/metrics",
                                   add, django_assert_max_num_queries, count=points)
