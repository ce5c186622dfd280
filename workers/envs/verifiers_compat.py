"""A `verifiers` (PyPI, v1 API) taskset as a Crucible environment.

The package's module exports one `vf.Taskset` subclass in `__all__` (the verifiers convention).
We list its tasks, let our policy answer them (single-turn chat, through the evaluator or the RL
rollout), and score each answer with the task's own `@vf.reward` functions: a `vf.Trace` holding
the prompt and the answer goes through `await task.score(trace)`, and `trace.reward` (the
weighted sum) is the total. Tasks that need a container or a runtime to score are refused at
load time: nothing here can provide one, and verifiers would silently skip those rewards.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.metadata
import inspect
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from workers.envs.base import Component, Environment, EnvTask, Message, Rubric, Score
from workers.envs.spec import VerifiersEnvSpec
from workers.envs.splits import eval_ids


class VerifiersError(ValueError):
    """The package cannot serve as an environment; the message says why."""


def _vf() -> ModuleType:
    try:
        return importlib.import_module("verifiers.v1")
    except ImportError as exc:
        raise VerifiersError(f"verifiers (>= 0.4, v1 API) is not importable: {exc}; install "
                             "the 'envs' extra") from exc


def taskset_class(module: ModuleType) -> type:
    vf = _vf()
    names = getattr(module, "__all__", None)
    if names is None:
        raise VerifiersError(f"module {module.__name__!r} defines no __all__; a verifiers "
                             "environment exports its Taskset subclass there")
    found = [obj for n in names if isinstance(obj := getattr(module, n, None), type)
             and issubclass(obj, vf.Taskset) and obj is not vf.Taskset]
    if len(found) != 1:
        raise VerifiersError(f"module {module.__name__!r} must export exactly one Taskset "
                             f"subclass in __all__, found {[c.__name__ for c in found]}")
    return found[0]


def _source_digest(module: ModuleType) -> str:
    """Hash of the module's Python source (the whole package for a package): its scoring code."""
    path = Path(getattr(module, "__file__", "") or "")
    files = sorted(path.parent.rglob("*.py")) if path.name == "__init__.py" else [path]
    h = hashlib.sha256()
    for file in files:
        if file.is_file():
            h.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    return h.hexdigest()


def _needs_runtime(fn: Any) -> bool:
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def _prompt_messages(data: Any) -> list[Message]:
    from verifiers.v1.types import content_text

    messages: list[Message] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        messages.extend({"role": m.role, "content": content_text(m.content) or ""}
                        for m in data.prompt or [])
    return messages


class VerifiersEnvironment(Environment):
    name = "verifiers"
    version = "1"

    def __init__(self, spec: VerifiersEnvSpec) -> None:
        try:
            self.module = importlib.import_module(spec.module)
        except ImportError as exc:
            raise VerifiersError(
                f"cannot import environment module {spec.module!r}: {exc}") from exc
        vf = _vf()
        from verifiers.v1.utils.generic import concrete_type

        cls = taskset_class(self.module)
        config_type = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        try:
            taskset = cls(config_type.model_validate(spec.args))
        except Exception as exc:  # noqa: BLE001 - the package's own validation errors
            raise VerifiersError(f"{cls.__name__} rejected args {spec.args}: {exc}") from exc
        if spec.limit is not None:
            taskset = taskset.take(spec.limit)
        elif not taskset.bounded:
            raise VerifiersError(f"{cls.__name__} yields tasks forever; set 'limit'")
        self.vf_tasks: dict[str, Any] = {}
        tasks: list[EnvTask] = []
        for vt in taskset:
            self._check_offline(vt)
            task_id = str(vt.data.id) if vt.data.id is not None else vt.key
            if task_id in self.vf_tasks:
                raise VerifiersError(f"two tasks share the id {task_id!r}")
            self.vf_tasks[task_id] = vt
            data = vt.data.model_dump(mode="json", exclude_none=True)
            answer = data.get("answer")
            tasks.append(EnvTask(
                id=task_id, prompt=vt.data.prompt_text,
                answer=str(answer) if answer is not None else None,
                reference=str(answer) if answer is not None else None,
                difficulty=_str_or_none(data.get("difficulty")),
                topic=_str_or_none(data.get("topic")),
                metadata={"key": vt.key, "data": data},
            ))
        if not tasks:
            raise VerifiersError(f"{cls.__name__} yielded no tasks")
        tasks = _split(tasks, spec)
        first = next(iter(self.vf_tasks.values()))
        rewards = first.hooks("reward")
        if not rewards:
            raise VerifiersError(f"{type(first).__name__} declares no @vf.reward")
        components = tuple(
            Component(name=fn.__name__, weight=float(getattr(fn, "_vf_weight", 1.0)),
                      fn=self._component_fn(fn.__name__), kind="verifiers.reward")
            for fn in rewards
        )
        versions = {"verifiers": importlib.metadata.version("verifiers")}
        if spec.distribution:
            try:
                versions[spec.distribution] = importlib.metadata.version(spec.distribution)
            except importlib.metadata.PackageNotFoundError as exc:
                raise VerifiersError(
                    f"distribution {spec.distribution!r} is not installed") from exc
        params = {**spec.model_dump(mode="json"), "versions": versions,
                  "source_sha256": _source_digest(self.module), "taskset": cls.__name__}
        super().__init__(tasks=tasks, rubric=Rubric(components), params=params,
                         name=f"verifiers:{spec.module}")

    @staticmethod
    def _check_offline(vt: Any) -> None:
        if type(vt).NEEDS_CONTAINER or vt.data.image:
            raise VerifiersError(f"task {type(vt).__name__} needs a container runtime, which "
                                 "Crucible does not provide to verifiers tasks")
        needy = [fn.__name__ for fn in (*vt.hooks("reward"), *vt.hooks("metric"))
                 if _needs_runtime(fn)]
        if needy or vt.config.judges:
            raise VerifiersError(f"task {type(vt).__name__} scores with a runtime or judge "
                                 f"({needy or 'judges'}), which cannot run offline")

    def initial_messages(self, task: EnvTask) -> list[Message]:
        return _prompt_messages(self.vf_tasks[task.id].data)

    def _traces(self, tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[Any]:
        vf = _vf()
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, TraceTask

        traces = []
        for task, completion in zip(tasks, completions, strict=True):
            vt = self.vf_tasks[task.id]
            nodes: list[Any] = []
            kinds = {"system": vf.SystemMessage, "assistant": vf.AssistantMessage}
            for m in self.initial_messages(task):  # few-shot turns keep their roles
                message = kinds.get(m["role"], vf.UserMessage)(content=m["content"])
                nodes.append(MessageNode(parent=len(nodes) - 1 if nodes else None,
                                         message=message))
            nodes.append(MessageNode(parent=len(nodes) - 1 if nodes else None, sampled=True,
                                     message=vf.AssistantMessage(content=completion)))
            traces.append(vf.Trace(
                task=TraceTask(type=type(vt).__name__, data=vt.data, key=vt.key, hash=vt.hash),
                agent=AgentInfo(config=vf.AgentConfig()), nodes=nodes, is_completed=True,
                ok=True,
            ))

        async def score_all() -> None:
            await asyncio.gather(*(self.vf_tasks[t.id].score(tr)
                                   for t, tr in zip(tasks, traces, strict=True)))

        asyncio.run(score_all())
        return traces

    def score(self, tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[Score]:
        """The task's own rewards: total = trace.reward (weighted), components unweighted."""
        out = []
        for trace in self._traces(tasks, completions):
            components = {n: float(r.score) if r is not None else 0.0
                          for n, r in trace.rewards.items()}
            info: dict[str, Any] = {"metrics": {k: v for k, v in trace.metrics.items()
                                                if v is not None}}
            missing = [n for n, r in trace.rewards.items() if r is None]
            if missing:
                info["unscored"] = missing
            out.append(Score(total=float(trace.reward), components=components, info=info))
        return out

    def _component_fn(self, name: str) -> Any:
        def fn(tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[tuple[float, dict]]:
            return [(s.components.get(name, 0.0), {}) for s in self.score(tasks, completions)]
        return fn


SPLIT_NAMES = {"train": "train", "training": "train", "eval": "eval", "evaluation": "eval",
               "test": "eval", "validation": "eval", "valid": "eval", "val": "eval",
               "dev": "eval", "held_out": "eval", "heldout": "eval"}
"""A task data's `split` value → ours (held-out names all mean eval)."""


def _split(tasks: list[EnvTask], spec: VerifiersEnvSpec) -> list[EnvTask]:
    """Each task's split: the one its data names (`split`: train, or eval/test/validation/…),
    else the deterministic `eval_fraction` split over the tasks that name none. A package that
    ships its own held-out set keeps it whole."""
    named: dict[str, str] = {}
    for task in tasks:
        raw = task.metadata["data"].get("split")
        if raw is None:
            continue
        split = SPLIT_NAMES.get(str(raw).strip().lower())
        if split is None:
            raise VerifiersError(f"task {task.id!r} has split {raw!r}; use one of "
                                 f"{', '.join(sorted(SPLIT_NAMES))}")
        named[task.id] = split
    rest = [t.id for t in tasks if t.id not in named]
    held = eval_ids(rest, spec.eval_fraction, spec.seed) if rest else set()
    return [EnvTask(**{**t.__dict__, "split": named.get(t.id)
                       or ("eval" if t.id in held else "train")}) for t in tasks]


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)
