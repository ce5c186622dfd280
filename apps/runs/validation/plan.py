"""A launch document turned into a frozen, validated :class:`RunPlan` (shared by create and
preview, so a preview that passes is a create that passes). Each concern has its module:
tags, pins (datasets, environments, QC gate), base_model, egress, train."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from pydantic import ValidationError

from apps.core import limits
from apps.core.exceptions import InvalidInput
from apps.datasets.models import DatasetVersion
from apps.environments.models import EnvironmentVersion
from apps.projects.models import Project
from apps.projects.selectors import project_by_slug
from apps.runs import hooks
from apps.runs.models import Checkpoint, Pool
from apps.runs.specs import KINDS, available_kinds
from apps.runs.validation.base_model import pin_serving_draft, resolve_base_model
from apps.runs.validation.egress import check_egress
from apps.runs.validation.pins import pin_datasets, pin_environments
from apps.runs.validation.resources import check_priority_class, check_resources
from apps.runs.validation.tags import validate_tags
from apps.runs.validation.train import check_train_config, check_training_datasets
from apps.teams.models import Team

MAX_ATTEMPTS_LIMIT = 20


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
    environments: list[EnvironmentVersion] = field(default_factory=list)
    base_checkpoint: Checkpoint | None = None
    base_model: dict[str, Any] | None = None
    max_attempts: int = 3
    tags: list[str] = field(default_factory=list)
    resources: dict[str, Any] = field(default_factory=dict)
    priority_class: str = "default"

    def describe(self) -> dict[str, Any]:
        return {
            "project": self.project.slug,
            "kind": self.kind,
            "name": self.name,
            "pool": self.pool,
            "priority": self.priority,
            "max_attempts": self.max_attempts,
            "tags": self.tags,
            "resources": self.resources,
            "priority_class": self.priority_class,
            "config": self.config,
            "datasets": {
                alias: {"dataset": v.dataset.slug, "digest": v.digest, "number": v.number,
                        "record_count": v.record_count}
                for alias, v in self.datasets.items()
            },
            "environment": _describe_env(self.environment) if self.environment else None,
            "environments": [_describe_env(v) for v in self.environments],
            "base_model": self.base_model,
        }


def _describe_env(version: EnvironmentVersion) -> dict[str, Any]:
    return {"environment": version.environment.slug, "digest": version.digest,
            "number": version.number, "qc_status": version.qc_status}


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
    environments: list[str] | None = None,
    base_model: str | None = None,
    max_attempts: int | None = None,
    tags: list[str] | None = None,
    resources: dict[str, Any] | None = None,
    priority_class: str | None = None,
) -> RunPlan:
    """Validate every field in a fixed order (the first problem is the one reported)."""
    if kind not in KINDS:
        raise InvalidInput(
            f"Run kind '{kind}' has no engine in this version of Crucible; available: "
            f"{', '.join(available_kinds())}.",
            details={"kind": [f"unavailable kind '{kind}'"]},
        )
    spec = KINDS[kind]
    limits.check_text(name or "", field="name", limit=limits.NAME)
    if not isinstance(config, dict):
        raise InvalidInput("config must be a JSON object.", details={"config": ["object"]})
    limits.check_json(config, field="config", limit=limits.CONFIG_BYTES)
    base_checkpoint, base_described = None, None
    if base_model:
        if not spec.base_model:
            raise InvalidInput(f"A {kind} run takes no base model.",
                               details={"base_model": [base_model[:100]]})
        config, base_checkpoint, base_described = resolve_base_model(
            team=team, ref=base_model, config=config)
    if kind == "eval":
        config, _draft = pin_serving_draft(team=team, config=config)
    try:
        parsed = spec.schema.model_validate(config)
    except ValidationError as exc:
        message, details = _config_errors(exc)
        raise InvalidInput(f"Invalid config: {message}", details=details) from exc
    if pool is not None and pool not in Pool.values:
        raise InvalidInput(f"Unknown pool '{pool}'; pools are {', '.join(Pool.values)}.",
                           details={"pool": [pool]})
    attempts = _max_attempts(max_attempts)
    requested = check_resources(resources, pool or spec.default_pool)
    klass = check_priority_class(priority_class, team)
    clean_tags = validate_tags(tags)
    project_obj = project_by_slug(team=team, slug=project)
    pinned = pin_datasets(team, spec, kind, datasets)
    env_versions = pin_environments(team, spec, kind, environment, environments)
    if kind == "train":
        check_train_config(parsed, env_versions)
        check_training_datasets(parsed, pinned)

    normalized = parsed.model_dump(mode="json")
    check_egress(normalized)
    hooks.check_launch(team, kind, normalized)
    if kind == "profile":
        _profile_dataset(normalized, pinned)
    return RunPlan(
        project=project_obj, kind=kind, name=name, config=normalized,
        pool=pool or spec.default_pool, priority=priority, datasets=pinned,
        environment=env_versions[0] if env_versions else None, environments=env_versions,
        base_checkpoint=base_checkpoint, base_model=base_described, max_attempts=attempts,
        tags=clean_tags, resources=requested, priority_class=klass,
    )


def _profile_dataset(config: dict[str, Any], pinned: dict[str, DatasetVersion]) -> None:
    """A profile run reads one pinned dataset: the one named, else the first pinned."""
    wanted_alias = config.get("dataset")
    if wanted_alias is None:
        config["dataset"] = next(iter(pinned))
    elif wanted_alias not in pinned:
        raise InvalidInput(
            f"config.dataset '{wanted_alias}' is not among the pinned datasets "
            f"({', '.join(pinned)}).",
            details={"config.dataset": ["not pinned"]},
        )


def _max_attempts(value: int | None) -> int:
    if value is None:
        return int(settings.CRUCIBLE.get("MAX_ATTEMPTS", 3))
    if isinstance(value, bool) or not isinstance(value, int) \
            or not 1 <= value <= MAX_ATTEMPTS_LIMIT:
        raise InvalidInput(f"max_attempts must be an integer from 1 to {MAX_ATTEMPTS_LIMIT}.",
                           details={"max_attempts": [repr(value)[:50]]})
    return value
