from __future__ import annotations

from typing import Any

from apps.core.exceptions import InvalidInput
from apps.environments.models import Environment, EnvironmentVersion
from apps.teams.models import Team


def version_lookup(environment: Environment, which: str) -> EnvironmentVersion | None:
    if which[:1] in "vV" and which[1:].isdigit():
        return environment.versions.filter(number=int(which[1:])).first()
    if len(which) >= 8:
        matches = list(environment.versions.filter(digest__startswith=which.lower())[:2])
        return matches[0] if len(matches) == 1 else None
    return None


def resolve_version(*, team: Team, ref: str) -> EnvironmentVersion:
    """``slug`` (latest version), ``slug@v2`` or ``slug@<digest prefix>``."""
    slug, _, which = ref.partition("@")
    env = Environment.objects.filter(team=team, slug=slug).first()
    if env is None:
        raise InvalidInput(f"Unknown environment '{slug}' in team '{team.slug}'.",
                           details={"environment": [f"unknown environment '{slug}'"]})
    version = version_lookup(env, which) if which else env.versions.order_by("-number").first()
    if version is None:
        raise InvalidInput(f"Environment reference '{ref}' matches no version.",
                           details={"environment": [f"unknown version '{ref}'"]})
    return version


def eval_reports(version: EnvironmentVersion, limit: int = 50) -> list[dict[str, Any]]:
    """The version's evaluations, newest first: each succeeded eval run with its report's
    policy and summary (the full report is the run's report)."""
    from apps.core.exceptions import DomainError
    from apps.runs import objects
    from apps.runs.models import Run, RunStatus

    runs = (Run.objects.filter(team_id=version.team_id, kind="eval",
                               environment_pins__environment_version=version,
                               status=RunStatus.SUCCEEDED)
            .exclude(report_uri="").order_by("-created_at")[:limit])
    rows = []
    for run in runs:
        try:
            report = objects.read_json(run, run.report_uri)
        except DomainError as exc:
            report = {"error": f"report unreadable: {exc.message}"}
        rows.append({"run": str(run.pk), "name": run.name, "created_at": run.created_at,
                     "report_uri": run.report_uri, "policy": report.get("policy"),
                     "split": report.get("split"), "k": report.get("k"),
                     "summary": report.get("summary"), "error": report.get("error")})
    return rows
