"""Environments: tasks with verifiable rewards (no Django).

`load_environment(spec)` builds one from its spec (`workers.envs.spec`: built-in, verifiers
package, or uploaded tasks); `as_objective(env)` serves it to the RL engine; `run_episodes` plays
multi-turn/tool episodes at the token level; `evaluate` runs a policy on a split. Submodules are
imported lazily, so `import workers.envs.spec` (the API's validation) loads pydantic models only.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "EnvTask": "base", "Environment": "base", "Rubric": "base", "Component": "base",
    "Score": "base", "Reply": "base", "Tool": "base",
    "load_environment": "load", "as_objective": "adapter", "EnvironmentObjective": "adapter",
    "run_episode": "rollout", "run_episodes": "rollout", "Episode": "rollout",
    "ChatMLCodec": "rollout",
    "evaluate": "eval", "pass_at_k": "eval", "render_html": "eval", "compare_reports": "eval",
    "CallablePolicy": "eval", "EndpointPolicy": "eval",
    "EnvironmentSpec": "spec", "parse_environment_spec": "spec",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)
