"""Generated math problems with exact answers, checked symbolically (`workers.envs.mathcheck`).

Topics: fraction sums, decimal products, percentages, linear equations, powers. The stored
answer is a plain fraction or integer ("1/2"); the reference completion writes it in LaTeX
(`\\boxed{\\frac{1}{2}}`), so QC itself exercises the symbolic equivalence.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from fractions import Fraction

from workers.envs import mathcheck
from workers.envs.base import Component, Environment, EnvTask, Rubric
from workers.envs.checkers import Sandbox, math_equiv, regex
from workers.envs.spec import MathParams
from workers.envs.splits import eval_ids
from workers.envs.tools import build_tools

INSTRUCTION = "Give the final answer as \\boxed{...}."


def _plain(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{value.numerator}/{value.denominator}"


def _latex(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def _fractions(rng: random.Random) -> tuple[str, Fraction, str]:
    a, b = Fraction(rng.randint(1, 9), rng.randint(2, 12)), Fraction(rng.randint(1, 9),
                                                                     rng.randint(2, 12))
    op = rng.choice("+-")
    value = a + b if op == "+" else a - b
    return (f"Compute {a.numerator}/{a.denominator} {op} {b.numerator}/{b.denominator} as an "
            "exact number.", value, "medium" if value.denominator > 6 else "easy")


def _decimals(rng: random.Random) -> tuple[str, Fraction, str]:
    x = Fraction(rng.randint(1, 99), 100)
    k = rng.randint(2, 40)
    return f"Compute {float(x):g} * {k}.", x * k, "easy"


def _percent(rng: random.Random) -> tuple[str, Fraction, str]:
    p, n = rng.choice([5, 10, 12, 15, 20, 25, 30, 40, 50, 75]), rng.randint(2, 400)
    return f"What is {p}% of {n}?", Fraction(p * n, 100), "easy"


def _linear(rng: random.Random) -> tuple[str, Fraction, str]:
    a = rng.choice([i for i in range(-9, 10) if i not in (0, 1)])
    b, c = rng.randint(-20, 20), rng.randint(-20, 20)
    value = Fraction(c - b, a)
    b_text = f"+ {b}" if b >= 0 else f"- {-b}"
    return (f"Solve for x: {a}x {b_text} = {c}. Answer with the value of x.", value,
            "hard" if value.denominator > 1 else "medium")


def _powers(rng: random.Random) -> tuple[str, Fraction, str]:
    base, exp = rng.randint(2, 9), rng.randint(-3, 6)
    return f"Compute {base}^{{{exp}}} exactly.", Fraction(base) ** exp, (
        "hard" if exp < 0 else "easy")


GENERATORS: dict[str, Callable[[random.Random], tuple[str, Fraction, str]]] = {
    "fractions": _fractions, "decimals": _decimals, "percent": _percent, "linear": _linear,
    "powers": _powers,
}


def generate(count: int, seed: int) -> list[EnvTask]:
    """`count` problems with distinct prompts (topics round-robin), deterministic in `seed`."""
    rng = random.Random(seed)
    topics = sorted(GENERATORS)
    seen: set[str] = set()
    tasks: list[EnvTask] = []
    attempts = 0
    while len(tasks) < count:
        attempts += 1
        if attempts > count * 50:
            raise ValueError(f"cannot generate {count} distinct math problems; ask for fewer")
        topic = topics[len(tasks) % len(topics)]
        text, value, difficulty = GENERATORS[topic](rng)
        if text in seen:
            continue
        seen.add(text)
        tasks.append(EnvTask(
            id=f"math-{len(tasks):05d}", prompt=f"{text} {INSTRUCTION}", answer=_plain(value),
            reference=f"The answer is \\boxed{{{_latex(value)}}}.", topic=topic,
            difficulty=difficulty,
        ))
    return tasks


class MathEnvironment(Environment):
    name = "math"
    version = "1"

    def __init__(self, params: MathParams, sandbox: Sandbox | None = None) -> None:
        tasks = generate(params.count, params.seed)
        held = eval_ids([t.id for t in tasks], params.eval_fraction, params.seed)
        tasks = [EnvTask(**{**t.__dict__, "split": "eval" if t.id in held else "train"})
                 for t in tasks]
        rubric = Rubric((
            Component("correct", 1.0, math_equiv(), "math_equiv"),
            Component("boxed", 0.0, regex(r"\\boxed\{"), "regex", {"pattern": r"\\boxed\{"}),
        ))
        tools = build_tools(list(params.tools), sandbox or Sandbox())
        super().__init__(
            tasks=tasks, rubric=rubric, mode="tool_use" if tools else "single_turn",
            max_turns=params.max_turns if tools else 1, tools=tools,
            params=params.model_dump(mode="json"),
        )

    def trivial_answers(self, task: EnvTask) -> list[str]:
        return ["\\boxed{}", "I don't know.", task.prompt]

    def wrong_answers(self, task: EnvTask) -> list[str]:
        return [f"\\boxed{{{w}}}" for w in mathcheck.perturbations(task.answer or "")]

    def self_check(self) -> list[str]:
        try:
            import math_verify  # noqa: F401
        except ImportError as exc:
            return [f"math-verify is not importable ({exc}); install the 'envs' extra"]
        return []
