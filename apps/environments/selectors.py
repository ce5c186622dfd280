from __future__ import annotations

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
