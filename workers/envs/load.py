"""Build an `Environment` from a spec: built-in, verifiers package, or uploaded tasks."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from pydantic import ValidationError

from workers.envs.base import Environment
from workers.envs.checkers import Sandbox
from workers.envs.spec import (
    BuiltinEnvSpec,
    DatasetRef,
    EnvironmentSpec,
    TaskRecord,
    TasksEnvSpec,
    TerminalEnvSpec,
    VerifiersEnvSpec,
    check_task_records,
    parse_environment_spec,
)
from workers.envs.terminal.task import TerminalTask, TerminalTaskError, parse_task
from workers.storage import ObjectStore

ResolveDataset = Callable[[DatasetRef], Iterable[Mapping[str, Any]]]
"""Returns a dataset version's records (a worker reads them from the object store:
:func:`stored_datasets`)."""


def stored_datasets(uris: Mapping[str, str], store: ObjectStore) -> ResolveDataset:
    """The resolver a worker passes to :func:`load_environment` and the QC engine: a pinned
    environment's dataset records read from the object-store URIs the claim listed by digest
    (``dataset_uris``), so the worker reads exactly the version the run pinned and nothing
    the team cannot see."""

    def records(ref: DatasetRef) -> Iterator[dict[str, Any]]:
        uri = uris.get(ref.digest)
        if uri is None:
            raise FileNotFoundError(f"environment dataset {ref.dataset} v{ref.version} "
                                    f"({ref.digest[:12]}) is not among the team's datasets")
        return (json.loads(line) for line in store.open_lines(uri) if line.strip())

    return records


def _builtin(spec: BuiltinEnvSpec, sandbox: Sandbox | None) -> Environment:
    params = spec.typed_params()
    if spec.name == "arithmetic":
        from workers.envs.builtins.arithmetic import ArithmeticEnvironment

        return ArithmeticEnvironment(params)  # type: ignore[arg-type]
    if spec.name == "math":
        from workers.envs.builtins.mathgen import MathEnvironment

        return MathEnvironment(params, sandbox)  # type: ignore[arg-type]
    if spec.name == "code":
        from workers.envs.builtins.code import CodeEnvironment

        return CodeEnvironment(params, sandbox)  # type: ignore[arg-type]
    if spec.name == "code_repair":
        from workers.envs.builtins.code import CodeRepairEnvironment

        return CodeRepairEnvironment(params, sandbox)  # type: ignore[arg-type]
    if spec.name == "humaneval":
        from workers.envs.builtins.humaneval import HumanEvalEnvironment

        return HumanEvalEnvironment(params, sandbox)  # type: ignore[arg-type]
    raise ValueError(f"unknown built-in environment {spec.name!r}")


def _dataset_rows(spec: TasksEnvSpec | TerminalEnvSpec, resolve_dataset: ResolveDataset | None,
                  parse: Callable[[Mapping[str, Any]], Any]) -> list[Any]:
    """The tasks of a spec: inline, or `parse` of each record of its dataset version; a
    record that does not parse is named by its number. Ids checked unique."""
    if spec.tasks is not None:
        return list(spec.tasks)
    assert spec.dataset is not None  # the spec validators guarantee one of the two
    if resolve_dataset is None:
        raise ValueError(f"environment reads dataset {spec.dataset.dataset!r} "
                         f"v{spec.dataset.version}, but no dataset resolver was given")
    rows = []
    for number, raw in enumerate(resolve_dataset(spec.dataset), start=1):
        try:
            rows.append(parse(raw))
        except (ValidationError, TerminalTaskError) as exc:
            if isinstance(exc, ValidationError):
                first = exc.errors()[0]
                why = f"{'.'.join(str(p) for p in first['loc']) or '<record>'}: {first['msg']}"
            else:
                why = str(exc)
            raise ValueError(f"dataset record {number} is not a task: {why}") from None
    check_task_records(rows)
    return rows


def _records(spec: TasksEnvSpec, resolve_dataset: ResolveDataset | None) -> list[TaskRecord]:
    return _dataset_rows(spec, resolve_dataset, TaskRecord.model_validate)


def terminal_tasks(spec: TerminalEnvSpec,
                   resolve_dataset: ResolveDataset | None = None) -> list[TerminalTask]:
    """A terminal environment's tasks: inline, or one per record of its dataset version
    (ValueError naming the record and field when one is not a task)."""
    return _dataset_rows(spec, resolve_dataset, lambda raw: parse_task(dict(raw)))


def load_environment(
    spec: EnvironmentSpec | Mapping[str, Any], *, sandbox: Sandbox | None = None,
    resolve_dataset: ResolveDataset | None = None,
) -> Environment:
    """The environment a spec describes. Raises ValueError (EnvSpecError, VerifiersError) with
    an actionable message when the spec is invalid or its package cannot serve."""
    parsed = spec if isinstance(spec, EnvironmentSpec) else parse_environment_spec(dict(spec))
    env = parsed.env
    if isinstance(env, BuiltinEnvSpec):
        return _builtin(env, sandbox)
    if isinstance(env, VerifiersEnvSpec):
        from workers.envs.verifiers_compat import VerifiersEnvironment

        return VerifiersEnvironment(env)
    if isinstance(env, TerminalEnvSpec):
        raise ValueError("a terminal environment is played in sandbox sessions "
                         "(workers.envs.terminal), not as single- or multi-turn tasks: train "
                         "on it through load_objective, QC it with workers.qc.terminal, "
                         "evaluate it with workers.envs.terminal.evaluate (run_eval does)")
    from workers.envs.builtins.uploaded import TasksEnvironment

    return TasksEnvironment(env, _records(env, resolve_dataset), sandbox)


def load_objective(
    spec: EnvironmentSpec | Mapping[str, Any], *, resolve_dataset: ResolveDataset | None = None,
    quarantined: Iterable[str] = (), name: str = "environment",
) -> Any:
    """What the RL engine trains on for a spec: terminal tasks as a `TerminalObjective` (played
    in sandbox sessions, graded by their hidden tests), any other source as its environment's
    `EnvironmentObjective`. Quarantined task ids are left out of both splits."""
    parsed = spec if isinstance(spec, EnvironmentSpec) else parse_environment_spec(dict(spec))
    if isinstance(parsed.env, TerminalEnvSpec):
        from workers.envs.terminal.objective import TerminalObjective

        return TerminalObjective(terminal_tasks(parsed.env, resolve_dataset), name=name,
                                 quarantined=set(quarantined))
    from workers.envs.adapter import as_objective

    return as_objective(load_environment(parsed, resolve_dataset=resolve_dataset),
                        quarantined=set(quarantined))
