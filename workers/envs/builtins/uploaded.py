"""Uploaded tasks (inline or from a dataset version) scored by a rubric of named checkers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from workers.envs import mathcheck
from workers.envs.base import Environment, EnvTask, Message, Reply, Rubric
from workers.envs.builtins.code import FEEDBACK
from workers.envs.checker_params import JsonFieldParams
from workers.envs.checkers import (
    Sandbox,
    build_component,
    grader_key,
    json_answers,
    numeric_answers,
    raise_if_infra,
)
from workers.envs.spec import TaskRecord, TasksEnvSpec
from workers.envs.tools import build_tools

CODE_CHECKERS = ("unit_tests", "stdio_cases", "call_cases")
ANSWER_CHECKERS = ("lcs_ratio", "edit_distance", "numeric", "json_field")
"""Partial-credit checkers that compare with each task's `answer`."""


def _checkers_of(kind: str, params: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """The checkers a component runs: itself, or a weighted component's parts."""
    if kind == "weighted":
        return [(str(p.get("checker")), p.get("params") or {})
                for p in params.get("checkers", [])]
    return [(kind, params)]


def to_env_task(record: TaskRecord) -> EnvTask:
    metadata: dict[str, object] = dict(record.metadata)
    if record.entry_point:
        metadata["entry_point"] = record.entry_point
    if record.cases:
        metadata["cases"] = [c.model_dump() for c in record.cases]
    if record.calls:
        metadata["calls"] = [c.model_dump() for c in record.calls]
    return EnvTask(id=record.id, prompt=record.prompt, answer=record.answer,
                   reference=record.reference if record.reference is not None else record.answer,
                   tests=record.tests, split=record.split, difficulty=record.difficulty,
                   topic=record.topic, metadata=metadata)


class TasksEnvironment(Environment):
    name = "tasks"
    version = "1"

    def __init__(self, spec: TasksEnvSpec, records: Sequence[TaskRecord],
                 sandbox: Sandbox | None = None) -> None:
        self.sandbox = sandbox or Sandbox()
        key = grader_key(self.name)
        components = tuple(build_component(c, self.sandbox, spec.limits, key)
                           for c in spec.rubric.components)
        self._code = [c for c in components if c.kind in CODE_CHECKERS]
        self._answer_checked = any(c.kind in ("math_equiv", "exact_match", "contains")
                                   for c in components)
        tools = build_tools(list(spec.interaction.tools), self.sandbox)
        params = spec.model_dump(mode="json", exclude={"tasks"})
        super().__init__(tasks=[to_env_task(r) for r in records], rubric=Rubric(components),
                         mode=spec.interaction.mode, max_turns=spec.interaction.max_turns,
                         tools=tools, params=params)
        missing = self._missing_fields()
        if missing:
            raise ValueError(missing)

    def _missing_fields(self) -> str | None:
        """Each task has what its rubric's checkers read; say which do not."""
        needs = {"unit_tests": lambda t: t.tests is not None,
                 "stdio_cases": lambda t: bool(t.metadata.get("cases")),
                 "call_cases": lambda t: bool(t.metadata.get("calls")),
                 "math_equiv": lambda t: t.answer is not None,
                 "exact_match": lambda t: t.answer is not None,
                 "contains": lambda t: t.answer is not None}
        field = {"unit_tests": "tests", "stdio_cases": "cases", "call_cases": "calls",
                 "math_equiv": "answer",
                 "exact_match": "answer", "contains": "answer"}
        for kind in ANSWER_CHECKERS:
            needs[kind], field[kind] = (lambda t: t.answer is not None), "answer"
        for comp in self.rubric.components:
            for kind, params in _checkers_of(comp.kind, comp.params):
                check = needs.get(kind)
                if check is None:
                    continue
                bad = [t.id for t in self.tasks if not check(t)]
                if bad:
                    return (f"component {comp.name!r} ({kind}) reads each task's "
                            f"'{field[kind]}', missing in tasks {bad[:5]}"
                            + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""))
                if kind == "numeric":
                    numeric_answers(self.tasks)  # raises, naming a non-numeric answer
                elif kind == "json_field":
                    json_answers(self.tasks, JsonFieldParams.model_validate(params))
        return None

    def respond(self, task: EnvTask, conversation: Sequence[Message]) -> Reply:
        if self.mode != "multi_turn":
            return super().respond(task, conversation)
        turns = sum(1 for m in conversation if m["role"] == "assistant")
        answer = conversation[-1]["content"]
        results = [c.fn([task], [answer])[0] for c in self._code]
        for _, info in results:
            raise_if_infra(info)
        if all(v >= 1.0 for v, _ in results) or turns >= self.max_turns:
            return Reply([], done=True)
        feedback = next((i.get("feedback") for v, i in results if v < 1.0), "") or (
            "the tests did not pass")
        return Reply([{"role": "user", "content": FEEDBACK.format(feedback=feedback)}],
                     done=False)

    def trivial_answers(self, task: EnvTask) -> list[str]:
        out = ["I don't know."]
        if self._code:
            out.append("```python\npass\n```")
        if self.rubric.graded_total > 0:
            # Under partial credit, copying the prompt is the cheapest way to earn something
            # (string tasks share characters with their prompt): QC bounds what it earns.
            out.append(task.prompt)
        return out

    def wrong_answers(self, task: EnvTask) -> list[str]:
        if not self._answer_checked or not task.answer:
            return []
        return mathcheck.perturbations(task.answer)
