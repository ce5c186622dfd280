"""Turn a launch request into a frozen, validated run document (shared by create and
preview, so a preview that passes is a create that passes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from apps.core.exceptions import InvalidInput
from apps.datasets.models import DatasetVersion
from apps.datasets.selectors import resolve_version as resolve_dataset
from apps.environments.models import EnvironmentVersion
from apps.environments.selectors import resolve_version as resolve_environment
from apps.projects.models import Project
from apps.projects.selectors import project_by_slug
from apps.runs.models import Pool
from apps.runs.specs import KINDS, available_kinds
from apps.teams.models import Team


@dataclass
class RunPlan:
    project: Project
    kind: str
    name: str
    config: dict[str, Any]
    pool: str
    priority: int
    datasets: dict[str, DatasetVersion]
    environment: EnvironmentVersion | None

    def describe(self) -> dict[str, Any]:
        return {
            "project": self.project.slug,
            "kind": self.kind,
            "name": self.name,
            "pool": self.pool,
            "priority": self.priority,
            "config": self.config,
            "datasets": {
                alias: {"dataset": v.dataset.slug, "digest": v.digest, "number": v.number,
                        "record_count": v.record_count}
                for alias, v in self.datasets.items()
            },
            "environment": (
                {"environment": self.environment.environment.slug,
                 "digest": self.environment.digest, "number": self.environment.number}
                if self.environment else None
            ),
        }


def _config_errors(exc: ValidationError) -> tuple[str, dict[str, list[str]]]:
    details: dict[str, list[str]] = {}
    for err in exc.errors():
        path = ".".join(str(p) for p in ("config", *err["loc"]))
        message = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        details.setdefault(path, []).append(message)
    first = next(iter(details.items()))
    return f"{first[0]}: {first[1][0]}", details


def plan_run(
    *,
    team: Team,
    project: str,
    kind: str,
    config: dict[str, Any],
    name: str = "",
    pool: str | None = None,
    priority: int = 0,
    datasets: list[str] | None = None,
    environment: str | None = None,
) -> RunPlan:
    if kind not in KINDS:
        raise InvalidInput(
            f"Run kind '{kind}' has no engine in this version of Crucible; available: "
            f"{', '.join(available_kinds())}.",
            details={"kind": [f"unavailable kind '{kind}'"]},
        )
    spec = KINDS[kind]
    if not isinstance(config, dict):
        raise InvalidInput("config must be a JSON object.", details={"config": ["object"]})
    try:
        parsed = spec.schema.model_validate(config)
    except ValidationError as exc:
        message, details = _config_errors(exc)
        raise InvalidInput(f"Invalid config: {message}", details=details) from exc
    if pool is not None and pool not in Pool.values:
        raise InvalidInput(f"Unknown pool '{pool}'; pools are {', '.join(Pool.values)}.",
                           details={"pool": [pool]})
    project_obj = project_by_slug(team=team, slug=project)

    pinned: dict[str, DatasetVersion] = {}
    for ref in datasets or []:
        version = resolve_dataset(team=team, ref=ref)
        alias = version.dataset.slug
        if alias in pinned:
            raise InvalidInput(f"Dataset '{alias}' is pinned twice.",
                               details={"datasets": [ref]})
        pinned[alias] = version
    low, high = spec.datasets
    if len(pinned) < low or (high is not None and len(pinned) > high):
        wanted = f"exactly {low}" if low == high else f"between {low} and {high}"
        raise InvalidInput(
            f"A {kind} run pins {wanted} dataset version(s); got {len(pinned)}.",
            details={"datasets": [f"{len(pinned)} given"]},
        )
    env_version = resolve_environment(team=team, ref=environment) if environment else None

    normalized = parsed.model_dump(mode="json")
    wanted_alias = normalized.get("dataset")
    if kind == "profile":
        if wanted_alias is None:
            normalized["dataset"] = next(iter(pinned))
        elif wanted_alias not in pinned:
            raise InvalidInput(
                f"config.dataset '{wanted_alias}' is not among the pinned datasets "
                f"({', '.join(pinned)}).",
                details={"config.dataset": ["not pinned"]},
            )
    return RunPlan(
        project=project_obj, kind=kind, name=name, config=normalized,
        pool=pool or spec.default_pool, priority=priority, datasets=pinned,
        environment=env_version,
    )
