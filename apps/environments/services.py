from __future__ import annotations

import hashlib
import json
from typing import Any

from django.db import transaction
from django.db.models import Max

from apps.core import audit, limits
from apps.core.actor import Actor
from apps.core.exceptions import Conflict, InvalidInput
from apps.datasets.records import canonical_line
from apps.environments.models import Environment, EnvironmentVersion, QcStatus
from apps.projects.models import Project
from apps.teams.models import Team
from workers.envs.spec import EnvSpecError, parse_environment_spec

MAX_SPEC_BYTES = 1 << 20


def spec_digest(spec: dict[str, Any]) -> str:
    """Same canonical JSON as dataset records, so equal specs hash equal."""
    return hashlib.sha256(canonical_line(spec)).hexdigest()


@transaction.atomic
def environment_create(
    *, actor: Actor, team: Team, project: Project, slug: str, description: str = ""
) -> Environment:
    limits.check_text(description, field="description", limit=limits.DESCRIPTION)
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


def parse_spec(spec: Any) -> dict[str, Any]:
    """Validate a registration with the engine's pure spec (built-in, verifiers package or
    uploaded tasks) and return its normalised document (defaults filled in), so equal
    environments written differently get one digest. Errors name every bad field."""
    if not isinstance(spec, dict) or not spec:
        raise InvalidInput("spec must be a non-empty JSON object.", details={"spec": ["object"]})
    limits.check_json(spec, field="spec", limit=limits.SPEC_BYTES)
    try:
        parsed = parse_environment_spec(spec)
    except EnvSpecError as exc:
        lines = str(exc).splitlines()[1:] or [str(exc)]
        details: dict[str, list[str]] = {}
        for line in lines:
            where, _, what = line.strip().partition(": ")
            details.setdefault(f"spec.{where}", []).append(what or where)
        first = lines[0].strip()
        raise InvalidInput(f"Invalid environment spec: {first}", details=details) from exc
    return parsed.model_dump(mode="json")


def version_register(
    *, actor: Actor, environment: Environment, spec: dict[str, Any]
) -> tuple[EnvironmentVersion, bool]:
    """A version from a user's spec: validated, normalised, content-addressed (the digest is
    the SHA-256 of the normalised spec's canonical JSON). QC starts pending."""
    return version_create(actor=actor, environment=environment, spec=parse_spec(spec))


QC_REPORT_DROPPED = ("tasks",)
"""Per-task rows stay in the object store copy; the version keeps the summary, quarantine
list, flags and block reasons (what launches and pages read)."""


def record_qc_report(
    *, actor: Actor, version: EnvironmentVersion, report: dict[str, Any], run_id: str,
    report_uri: str,
) -> EnvironmentVersion:
    """A QC run's finding: passed unless the report blocks the version."""
    if not isinstance(report, dict) or "passed" not in report:
        raise InvalidInput("A QC report is the engine's crucible.qc/1 object (with 'passed').",
                           details={"report": ["missing 'passed'"]})
    stored = {k: v for k, v in report.items() if k not in QC_REPORT_DROPPED}
    stored.update({"run": run_id, "report_uri": report_uri})
    passed = bool(report.get("passed")) and not report.get("blocked")
    return record_qc(actor=actor, version=version, passed=passed, report=stored)


def blocked_reason(version: EnvironmentVersion) -> str:
    """Why training may not use this version ("" when it may or QC has not run)."""
    if version.qc_status != QcStatus.FAILED:
        return ""
    report = version.qc_report if isinstance(version.qc_report, dict) else {}
    reasons = report.get("block_reasons")
    if isinstance(reasons, list) and reasons:
        return "; ".join(str(r) for r in reasons)
    return "QC failed; see qc_report"
