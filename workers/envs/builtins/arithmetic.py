"""The built-in arithmetic problems: `a+b=` answered with the exact integer, rewarded by exact
match, both as the RL engine's demo objective (`ArithmeticObjective`, what a run config's `task`
section builds) and as the `arithmetic` environment (same problems, same split, same reward:
exact match plus the weight-0 `is_number` metric).

Problems are enumerated exhaustively and split with a fixed seed, so the held-out prompts are
never seen in SFT or RL. Kept here, below the RL engine, so environments never import it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from workers.envs.base import Component, Environment, EnvTask, Example, Rubric
from workers.envs.spec import ArithmeticSpec

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def parse_answer(completion: str) -> str:
    """The answer is the completion up to the first newline, stripped."""
    return completion.split("\n", 1)[0].strip()


def exact_match(
    examples: Sequence[Example], completions: Sequence[str]
) -> tuple[list[float], dict[str, list[float]]]:
    """1.0 where the answer equals the reference; `is_number` beside it for metrics."""
    correct = [float(parse_answer(c) == ex.reference) for ex, c in zip(examples, completions,
                                                                       strict=True)]
    # A shaping-free component that shows whether the model at least emits a number.
    numeric = [float(parse_answer(c).lstrip("-").isdigit()) for c in completions]
    return correct, {"exact_match": correct, "is_number": numeric}


class ArithmeticObjective:
    """Every `a op b` in the spec's operand range, shuffled once by its seed and split into
    held-out and training problems (the RL engine's `Objective`)."""

    def __init__(self, spec: ArithmeticSpec) -> None:
        rng = random.Random(spec.seed)
        rng_ops = range(spec.min_operand, spec.max_operand + 1)
        problems = [
            Example(prompt=f"{a}{op}{b}=", reference=str(_OPS[op](a, b)))
            for op in spec.ops
            for a in rng_ops
            for b in rng_ops
        ]
        rng.shuffle(problems)
        if spec.eval_size >= len(problems):
            raise ValueError(
                f"task.eval_size={spec.eval_size} leaves no training problems "
                f"(only {len(problems)} exist)"
            )
        self.eval: list[Example] = problems[: spec.eval_size]
        self.train: list[Example] = problems[spec.eval_size :]
        self.reward = exact_match

    def corpus(self) -> list[str]:
        """Every problem with its answer: the text a demo tokenizer is trained on."""
        return [ex.prompt + ex.reference for ex in self.train + self.eval] + ["\n"]


def build_objective(spec: ArithmeticSpec | None = None) -> ArithmeticObjective:
    """The arithmetic objective; None (a run config without `task`) means its defaults."""
    return ArithmeticObjective(spec or ArithmeticSpec())


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
        demo = ArithmeticObjective(spec)
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
