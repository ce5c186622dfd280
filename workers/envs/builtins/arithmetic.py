"""The RL demo task (`workers.rl.tasks.arithmetic`) as an environment: same problems, same
split, same reward (exact match, plus the weight-0 `is_number` metric)."""

from __future__ import annotations

from collections.abc import Sequence

from workers.envs.base import Component, Environment, EnvTask, Rubric
from workers.rl.spec import ArithmeticSpec
from workers.rl.tasks.arithmetic import ArithmeticTask, exact_match
from workers.rl.tasks.base import Example


def _task(example: Example, split: str) -> EnvTask:
    op = next(c for c in example.prompt[1:] if c in "+-*")
    return EnvTask(id=example.prompt.rstrip("="), prompt=example.prompt, answer=example.reference,
                   reference=example.reference, split=split,  # type: ignore[arg-type]
                   topic={"+": "addition", "-": "subtraction", "*": "multiplication"}[op],
                   difficulty="easy" if abs(int(example.reference)) < 10 else "medium")


def _component(name: str) -> Component:
    def fn(tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[tuple[float, dict]]:
        examples = [Example(prompt=t.prompt, reference=t.answer or "") for t in tasks]
        _, parts = exact_match(examples, completions)
        return [(v, {}) for v in parts[name]]
    return Component(name=name, weight=1.0 if name == "exact_match" else 0.0, fn=fn,
                     kind=f"rl.arithmetic.{name}")


class ArithmeticEnvironment(Environment):
    name = "arithmetic"
    version = "1"

    def __init__(self, spec: ArithmeticSpec) -> None:
        demo = ArithmeticTask(spec)
        tasks = [_task(e, "train") for e in demo.train] + [_task(e, "eval") for e in demo.eval]
        super().__init__(tasks=tasks, rubric=Rubric((_component("exact_match"),
                                                     _component("is_number"))),
                         params=spec.model_dump(mode="json"))
        self.demo = demo

    def trivial_answers(self, task: EnvTask) -> list[str]:
        return ["?", "=", task.prompt]

    def wrong_answers(self, task: EnvTask) -> list[str]:
        value = int(task.answer or 0)
        return [str(value + 1), str(value - 1), f"{value}1"]
