"""The objective a run config names: its `environment` (any spec the platform accepts, loaded
as the platform's workers load a pinned version), else the built-in arithmetic objective (the
config's `task` section holds its settings).

This is what `python -m workers.rl train` trains on, so a user can iterate on an environment
locally before registering it and launching on the platform; a platform worker passes the
objective of the run's pinned environment versions to `train(objective=...)` instead.
"""

from __future__ import annotations

from typing import Any

from workers.envs.builtins.arithmetic import build_objective
from workers.rl.objectives.base import Objective
from workers.rl.spec import RunSpec


def objective_from_spec(spec: RunSpec) -> Objective:
    if spec.environment is None:
        return build_objective(spec.task)
    from workers.envs.load import load_objective

    env: dict[str, Any] = spec.environment
    if env.get("source") == "tasks" and env.get("dataset") is not None:
        raise ValueError("environment.dataset names a platform dataset version, which a local "
                         "run cannot read: give the records as environment.tasks_file (JSONL) "
                         "or inline environment.tasks")
    return load_objective(env)
