"""Checks only a train run needs: fields of the engine's local config that the platform
sets itself, and pinned datasets that must be warm-start data."""

from __future__ import annotations

from typing import Any

from apps.core.exceptions import InvalidInput
from apps.datasets.models import DatasetVersion
from apps.datasets.selectors import read_records
from apps.environments.models import EnvironmentVersion


def check_train_config(parsed: Any, env_versions: list[EnvironmentVersion]) -> None:
    """Fields of the engine's config that a platform run would carry without using them are
    refused, so the frozen config says only what the run did: the environment comes from the
    pinned versions (QC-gated), the checkpoint folder from the worker (checkpoints live in the
    object store)."""
    if parsed.environment is not None:
        raise InvalidInput(
            "config.environment is for local runs (python -m workers.rl train); on the "
            "platform register it as an environment version, let QC pass it, and pin it with "
            "'environments'.", details={"config.environment": ["not used on the platform"]})
    if parsed.task is not None and env_versions:
        pins = ", ".join(f"{v.environment.slug}@v{v.number}" for v in env_versions)
        raise InvalidInput(
            f"config.task (the built-in arithmetic task) does not apply: this run trains on "
            f"its pinned environment(s) {pins}; remove config.task.",
            details={"config.task": ["the pinned environments replace it"]})
    if parsed.checkpoint.dir is not None:
        raise InvalidInput(
            "config.checkpoint.dir is chosen by the worker on the platform (a scratch folder "
            "per attempt; checkpoints are kept in the object store); remove it.",
            details={"config.checkpoint.dir": ["set by the worker"]})


def check_training_datasets(parsed: Any, pinned: dict[str, DatasetVersion]) -> None:
    """A train run's pinned datasets are warm-start data (SFT pairs or preference pairs): each
    must have that shape (judged by its first record; the worker checks every record) and its
    phase must be on, so no pinned dataset is silently ignored."""
    from workers.rl.spec import PinnedDataError, check_roles, record_role, shape_hint

    templated = parsed.sft.prompt_template is not None
    roles = {}
    for alias, version in pinned.items():
        label = f"{alias}@v{version.number}"
        first = read_records(version, offset=0, limit=1)
        role = record_role(first[0], templated=templated) if first else None
        if role is None:
            fields = sorted(first[0]) if first and isinstance(first[0], dict) else []
            raise InvalidInput(
                f"Dataset {label} cannot be a training dataset: {shape_hint()}; its first "
                f"record has {', '.join(fields) or 'nothing'}.",
                details={"datasets": [f"{label}: not SFT or preference records"]},
            )
        roles[label] = role
    try:
        check_roles(roles, sft_steps=parsed.sft.steps, sft_environment=parsed.sft.environment,
                    preference_steps=parsed.preference.steps)
    except PinnedDataError as exc:
        raise InvalidInput(f"Invalid config: {exc}", details={"datasets": [str(exc)]}) from exc
