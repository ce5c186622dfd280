from __future__ import annotations

from django.db.models import Count, QuerySet

from apps.core.exceptions import InvalidInput
from apps.projects.models import Project
from apps.teams.models import Team


def project_by_slug(*, team: Team, slug: str) -> Project:
    project = Project.objects.filter(team=team, slug=slug).first()
    if project is None:
        raise InvalidInput(
            f"No project '{slug}' in team '{team.slug}'; create it first.",
            details={"project": [f"unknown project '{slug}'"]},
        )
    return project


def with_run_counts(team: Team) -> QuerySet[Project]:
    """The team's projects by slug, each annotated with ``n_runs``."""
    return Project.objects.filter(team=team).annotate(n_runs=Count("runs")).order_by("slug")
