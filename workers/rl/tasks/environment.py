"""The task a run config names: its `environment` (any spec the platform accepts, loaded as
the platform's workers load a pinned version), else the built-in arithmetic task.

This is what `python -m workers.rl train` trains on, so a user can iterate on an environment
locally before registering it and launching on the platform; a platform worker passes the
task of the run's pinned environment versions to `train(task=...)` instead.
"""

from __future__ import annotations

from typing import Any

from workers.envs.builtins.arithmetic import build_task
from workers.rl.spec import RunSpec
from workers.rl.tasks.base import Task


def task_from_spec(spec: RunSpec) -> Task:
    if spec.environment is None:
        return build_task(spec.task)
    from workers.envs.adapter import as_rl_task
    from workers.envs.load import load_environment

    env: dict[str, Any] = spec.environment
    if env.get("source") == "tasks" and env.get("dataset") is not None:
        raise ValueError("environment.dataset names a platform dataset version, which a local "
                         "run cannot read: give the records as environment.tasks_file (JSONL) "
                         "or inline environment.tasks")
    return as_rl_task(load_environment(env))
