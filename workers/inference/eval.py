"""Evaluate a policy on an environment end to end: load the environment, and evaluate an
OpenAI-compatible endpoint, or a local checkpoint served by this inference engine for the
duration, with `workers.envs.eval.evaluate` (terminal tasks: `workers.envs.terminal.evaluate`,
episodes in sandbox sessions).

It lives here, not in `workers.envs`, because serving a checkpoint needs the inference engine,
which builds on the RL engine, which builds on the environments.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from workers.envs.eval import EndpointPolicy, evaluate
from workers.envs.load import load_environment, terminal_tasks
from workers.envs.spec import (
    CheckpointPolicySpec,
    EndpointPolicySpec,
    EnvironmentSpec,
    EvalSpec,
    TerminalEnvSpec,
    parse_environment_spec,
)
from workers.inference.server import start_server


def _checkpoint_dir(spec: CheckpointPolicySpec) -> str:
    parsed = urlparse(spec.uri)
    if parsed.scheme not in ("", "file"):
        raise ValueError(f"checkpoint {spec.uri!r} is not local: fetch it from the object store "
                         "first and pass its directory")
    path = Path(unquote(parsed.path) if parsed.scheme else spec.uri)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a Hugging Face checkpoint directory (no config.json)")
    return str(path)


def run_eval(
    env_spec: EnvironmentSpec | dict[str, Any], eval_spec: EvalSpec | dict[str, Any], *,
    include_samples: bool = False, exclude: Sequence[str] = (), **load_kwargs: Any,
) -> dict[str, Any]:
    """Load the environment, build the policy (an endpoint, or a local checkpoint served by
    the inference engine for the duration), evaluate, and return the report."""
    spec = eval_spec if isinstance(eval_spec, EvalSpec) else EvalSpec.model_validate(eval_spec)
    parsed = env_spec if isinstance(env_spec, EnvironmentSpec) else parse_environment_spec(
        dict(env_spec))
    kwargs: dict[str, Any] = {
        "split": spec.split, "samples_per_task": spec.samples_per_task, "k": spec.k,
        "sampling": spec.sampling, "limit": spec.limit, "concurrency": spec.concurrency,
        "include_samples": include_samples, "exclude": exclude}
    if isinstance(parsed.env, TerminalEnvSpec):
        # played in sandbox sessions with the policy's tool calls (see that module)
        from workers.envs.terminal.evaluate import evaluate_terminal

        tasks = terminal_tasks(parsed.env, load_kwargs.get("resolve_dataset"))

        def run(policy: EndpointPolicy) -> dict[str, Any]:
            return evaluate_terminal(tasks, policy, **kwargs)
    else:
        env = load_environment(parsed, **load_kwargs)

        def run(policy: EndpointPolicy) -> dict[str, Any]:
            return evaluate(env, policy, **kwargs)
    if isinstance(spec.policy, EndpointPolicySpec):
        policy = EndpointPolicy(spec.policy)
        try:
            return run(policy)
        finally:
            policy.close()
    model_dir = _checkpoint_dir(spec.policy)
    with start_server(model_dir, name="policy") as server:
        policy = EndpointPolicy(EndpointPolicySpec(base_url=server.url, model="policy"))
        try:
            report = run(policy)
        finally:
            policy.close()
    report["policy"]["checkpoint"] = spec.policy.uri
    return report
