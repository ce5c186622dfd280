from __future__ import annotations

from django.db import transaction

from apps.core import audit, limits
from apps.core.actor import Actor
from apps.core.exceptions import Conflict
from apps.projects.models import Project
from apps.teams.models import Team


@transaction.atomic
def project_create(
    *, actor: Actor, team: Team, slug: str, name: str = "", description: str = ""
) -> Project:
    limits.check_text(description, field="description", limit=limits.DESCRIPTION)
    if Project.objects.filter(team=team, slug=slug).exists():
        raise Conflict(f"Project '{slug}' already exists in team '{team.slug}'.")
    project = Project.objects.create(
        team=team, slug=slug, name=name or slug, description=description, created_by=actor.user
    )
    audit.record(actor=actor, action="project.create", team_id=team.pk, target_type="project",
                 target_id=slug)
    return project


@transaction.atomic
def project_update(*, actor: Actor, project: Project, **fields: str) -> Project:
    if "description" in fields:
        limits.check_text(fields["description"], field="description", limit=limits.DESCRIPTION)
    for name, value in fields.items():
        setattr(project, name, value)
    project.save(update_fields=list(fields))
    audit.record(actor=actor, action="project.update", team_id=project.team_id,
                 target_type="project", target_id=project.slug, data=fields)
    return project
