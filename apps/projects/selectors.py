from __future__ import annotations

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
