from __future__ import annotations

from django.db.models import Count, OuterRef, Subquery

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


def environment_by_slug(team: Team, slug: str) -> Environment | None:
    return Environment.objects.select_related("project").filter(team=team, slug=slug).first()


def environments_with_latest(team: Team
                             ) -> tuple[list[Environment], dict[int, EnvironmentVersion]]:
    """The team's environments by slug, each annotated with ``n_versions`` and
    ``latest_id``, and their latest versions by id (two queries for the whole table)."""
    latest = EnvironmentVersion.objects.filter(environment=OuterRef("pk")).order_by("-number")
    envs = list(Environment.objects.filter(team=team).select_related("project")
                .annotate(n_versions=Count("versions"),
                          latest_id=Subquery(latest.values("pk")[:1]))
                .order_by("slug"))
    return envs, EnvironmentVersion.objects.in_bulk([e.latest_id for e in envs if e.latest_id])


def versions_newest_first(env: Environment, limit: int) -> list[EnvironmentVersion]:
    return list(env.versions.select_related("created_by").order_by("-number")[:limit])
