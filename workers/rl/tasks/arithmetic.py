"""The demo task: `a+b=` answered with the exact integer, rewarded by exact match.

Problems are enumerated exhaustively and split with a fixed seed, so the held-out prompts are
never seen in SFT or RL.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from workers.rl.spec import ArithmeticSpec
from workers.rl.tasks.base import Example

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def parse_answer(completion: str) -> str:
    """The answer is the completion up to the first newline, stripped."""
    return completion.split("\n", 1)[0].strip()


def exact_match(
    examples: Sequence[Example], completions: Sequence[str]
) -> tuple[list[float], dict[str, list[float]]]:
    correct = [float(parse_answer(c) == ex.reference) for ex, c in zip(examples, completions,
                                                                       strict=True)]
    # A shaping-free component that shows whether the model at least emits a number.
    numeric = [float(parse_answer(c).lstrip("-").isdigit()) for c in completions]
    return correct, {"exact_match": correct, "is_number": numeric}


class ArithmeticTask:
    def __init__(self, spec: ArithmeticSpec):
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
        return [ex.prompt + ex.reference for ex in self.train + self.eval] + ["\n"]


def build_task(spec: ArithmeticSpec | None = None) -> ArithmeticTask:
    """The arithmetic task; None (a run config without `task`) means its defaults."""
    return ArithmeticTask(spec or ArithmeticSpec())
