"""A run's ``resources`` and ``priority_class``: validated with the scheduler's own schema
(``workers.scheduling.spec``) so what a launch accepts is what a pass can place."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from apps.core.exceptions import InvalidInput
from apps.runs.models import Pool
from apps.scheduling import queues
from apps.teams.models import Team
from workers.scheduling.spec import DEFAULT_PRIORITY_CLASSES, Resources


def default_resources(pool: str) -> Resources:
    """Today's pool semantics: a GPU-pool run takes one GPU on one node; CPU and sandbox
    runs one CPU core."""
    if pool == Pool.GPU:
        return Resources(gpus_per_node=1, nodes=1)
    return Resources(gpus_per_node=0, nodes=1, cpus=1.0)


def check_resources(value: Any, pool: str) -> dict[str, Any]:
    """The request as stored on the run (JSON), or InvalidInput naming the bad field."""
    if value is None:
        return default_resources(pool).model_dump(mode="json")
    if not isinstance(value, dict):
        raise InvalidInput("resources must be a JSON object (gpus_per_node, nodes, gpu_types, "
                           "cpus, memory_gb, max_runtime_s).", details={"resources": ["object"]})
    try:
        parsed = Resources.model_validate(value)
    except ValidationError as exc:
        details: dict[str, list[str]] = {}
        for err in exc.errors():
            path = ".".join(str(p) for p in ("resources", *err["loc"]))
            message = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
            details.setdefault(path, []).append(message)
        first = next(iter(details.items()))
        raise InvalidInput(f"Invalid resources: {first[0]}: {first[1][0]}",
                           details=details) from exc
    if pool == Pool.GPU and parsed.gpus_per_node == 0:
        raise InvalidInput("resources.gpus_per_node: a gpu-pool run asks for at least one GPU "
                           "(use pool 'cpu' for CPU work).",
                           details={"resources.gpus_per_node": ["at least 1 on pool gpu"]})
    if pool != Pool.GPU and parsed.gpus_per_node > 0:
        raise InvalidInput(f"resources.gpus_per_node: a {pool}-pool run gets no GPUs; launch "
                           "it on pool 'gpu'.",
                           details={"resources.gpus_per_node": [f"0 on pool {pool}"]})
    return parsed.model_dump(mode="json")


def check_priority_class(value: str | None, team: Team) -> str:
    """One of the priority classes; by default the team queue's default class."""
    names = [c.name for c in DEFAULT_PRIORITY_CLASSES]
    if value is None or value == "":
        return queues.default_priority(team.pk)
    if value not in names:
        raise InvalidInput(f"priority_class '{value}' is not one of {', '.join(names)}.",
                           details={"priority_class": [str(value)[:64]]})
    return value
