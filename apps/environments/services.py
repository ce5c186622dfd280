from __future__ import annotations

import hashlib
import json
from typing import Any

from django.db import transaction
from django.db.models import Max

from apps.core import audit
from apps.core.actor import Actor
from apps.core.exceptions import Conflict, InvalidInput
from apps.datasets.records import canonical_line
from apps.environments.models import Environment, EnvironmentVersion, QcStatus
from apps.projects.models import Project
from apps.teams.models import Team

MAX_SPEC_BYTES = 1 << 20


def spec_digest(spec: dict[str, Any]) -> str:
    """Same canonical JSON as dataset records, so equal specs hash equal."""
    return hashlib.sha256(canonical_line(spec)).hexdigest()


@transaction.atomic
def environment_create(
    *, actor: Actor, team: Team, project: Project, slug: str, description: str = ""
) -> Environment:
    if Environment.objects.filter(team=team, slug=slug).exists():
        raise Conflict(f"Environment '{slug}' already exists in team '{team.slug}'.")
    env = Environment.objects.create(team=team, project=project, slug=slug,
                                     description=description, created_by=actor.user)
    audit.record(actor=actor, action="environment.create", team_id=team.pk,
                 target_type="environment", target_id=slug)
    return env


@transaction.atomic
def version_create(
    *, actor: Actor, environment: Environment, spec: dict[str, Any]
) -> tuple[EnvironmentVersion, bool]:
    if not isinstance(spec, dict) or not spec:
        raise InvalidInput("spec must be a non-empty JSON object.", details={"spec": ["object"]})
    digest = spec_digest(spec)
    if len(json.dumps(spec)) > MAX_SPEC_BYTES:
        raise InvalidInput(f"spec is larger than {MAX_SPEC_BYTES} bytes; put data in a dataset.")
    locked = Environment.objects.select_for_update().get(pk=environment.pk)
    existing = locked.versions.filter(digest=digest).first()
    if existing is not None:
        return existing, False
    number = (locked.versions.aggregate(n=Max("number"))["n"] or 0) + 1
    version = EnvironmentVersion.objects.create(
        team_id=locked.team_id, environment=locked, number=number, digest=digest, spec=spec,
        created_by=actor.user,
    )
    audit.record(actor=actor, action="environment.version.create", team_id=locked.team_id,
                 target_type="environment_version", target_id=digest,
                 data={"environment": locked.slug, "number": number})
    return version, True


@transaction.atomic
def record_qc(
    *, actor: Actor, version: EnvironmentVersion, passed: bool, report: dict[str, Any]
) -> EnvironmentVersion:
    version.qc_status = QcStatus.PASSED if passed else QcStatus.FAILED
    version.qc_report = report
    version.save(update_fields=["qc_status", "qc_report"])
    audit.record(actor=actor, action="environment.qc", team_id=version.team_id,
                 target_type="environment_version", target_id=version.digest,
                 data={"status": version.qc_status})
    return version
