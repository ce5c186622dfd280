"""Math generators and their two verification stages, against hand-made items."""

from __future__ import annotations

import random

import pytest

from workers.synthesis import adversarial
from workers.synthesis.math_topics import TOPICS, Degenerate
from workers.synthesis.math_verify import verify


def _last(topic: str, question: str, answer: str, problem: dict) -> tuple[bool, str]:
    trail = verify(topic, question, answer, problem)
    return trail[-1].ok, trail[-1].check


@pytest.mark.parametrize("topic", sorted(TOPICS))
def test_every_topic_and_difficulty_builds_verified_items(topic: str) -> None:
    built = 0
    for d in range(1, 6):
        for seed in range(2):
            t = TOPICS[topic]
            try:
                item = t.build(t.sample(random.Random(seed * 10 + d), d))
            except Degenerate:
                continue
            trail = verify(topic, item.question, item.answer, item.problem)
            assert [c.stage for c in trail] == ["syntax", "logic"], trail
            assert trail[-1].ok, (item, trail)
            built += 1
    assert built >= 8


def test_generation_is_reproducible() -> None:
    t = TOPICS["quadratic"]
    a = t.build(t.sample(random.Random(5), 4))
    b = t.build(t.sample(random.Random(5), 4))
    assert a == b


@pytest.mark.parametrize(("topic", "question", "answer", "problem", "expected"), [
    ("linear", "Solve for x: 2*x + 3 = 7.", "2", {"lhs": "2*x + 3", "rhs": "7", "variable": "x"},
     (True, "re-derived")),
    ("linear", "Solve for x: 2*x + 3 = 7.", "3", {"lhs": "2*x + 3", "rhs": "7", "variable": "x"},
     (False, "logic:answer_mismatch")),
    ("quadratic", "Solve for x: x**2 - 5*x + 6 = 0.", "[2, 3]",
     {"lhs": "x**2 - 5*x + 6", "rhs": "0", "variable": "x"}, (True, "re-derived")),
    ("quadratic", "Solve for x: x**2 - 5*x + 6 = 0.", "[2]",
     {"lhs": "x**2 - 5*x + 6", "rhs": "0", "variable": "x"}, (False, "logic:answer_mismatch")),
    ("quadratic", "Solve for x: x**2 - 2 = 0.", "[-sqrt(2), sqrt(2)]",
     {"lhs": "x**2 - 2", "rhs": "0", "variable": "x"}, (True, "re-derived")),
    ("system", "Solve: x + y = 3 and x - y = 1.", "(2, 1)",
     {"equations": [["x + y", "3"], ["x - y", "1"]], "variables": ["x", "y"]},
     (True, "re-derived")),
    ("system", "Solve: x + y = 3 and x - y = 1.", "(1, 2)",
     {"equations": [["x + y", "3"], ["x - y", "1"]], "variables": ["x", "y"]},
     (False, "logic:answer_mismatch")),
    ("derivative", "Differentiate x**2*sin(x).", "2*x*sin(x) + x**2*cos(x)",
     {"function": "x**2*sin(x)", "variable": "x"}, (True, "re-derived")),
    ("derivative", "Differentiate x**2*sin(x).", "2*x*cos(x)",
     {"function": "x**2*sin(x)", "variable": "x"}, (False, "logic:answer_mismatch")),
    ("integral", "Find an antiderivative of 2*x*cos(x**2).", "sin(x**2) + 5",
     {"integrand": "2*x*cos(x**2)", "variable": "x", "lower": None, "upper": None},
     (True, "re-derived")),
    ("integral", "Integrate 3*x**2 from 0 to 2.", "8",
     {"integrand": "3*x**2", "variable": "x", "lower": 0, "upper": 2}, (True, "re-derived")),
    ("integral", "Integrate 3*x**2 from 0 to 2.", "9",
     {"integrand": "3*x**2", "variable": "x", "lower": 0, "upper": 2},
     (False, "logic:answer_mismatch")),
    ("gcd", "gcd of 12, 18?", "6", {"op": "gcd", "numbers": [12, 18]}, (True, "re-derived")),
    ("gcd", "lcm of 4, 6?", "24", {"op": "lcm", "numbers": [4, 6]},
     (False, "logic:answer_mismatch")),
    ("modular", "Compute 3**4 mod 7.", "4", {"op": "powmod", "a": 3, "b": 4, "m": 7},
     (True, "re-derived")),
    ("modular", "Inverse of 3 mod 7?", "5", {"op": "inverse", "a": 3, "b": 0, "m": 7},
     (True, "re-derived")),
    ("primes", "Is 91 prime?", "yes", {"op": "isprime", "n": 91},
     (False, "logic:answer_mismatch")),
    ("primes", "Factor 360.", "2**3*3**2*5", {"op": "factor", "n": 360}, (True, "re-derived")),
    ("primes", "Factor 360.", "2**3*3*5", {"op": "factor", "n": 360},
     (False, "logic:answer_mismatch")),
    # the question must state the problem it is about
    ("linear", "Solve for x: 2*x + 4 = 7.", "2", {"lhs": "2*x + 3", "rhs": "7", "variable": "x"},
     (False, "logic:question_mismatch")),
])
def test_hand_made_items(topic: str, question: str, answer: str, problem: dict,
                         expected: tuple[bool, str]) -> None:
    assert _last(topic, question, answer, problem) == expected


@pytest.mark.parametrize(("expression", "code"), [
    ("__import__('os').system('true')", "syntax:forbidden"),
    ("x.__class__", "syntax:forbidden"),
    ("9**9**9**9", "syntax:bad_exponent"),
    ("foo(x)", "syntax:forbidden"),
    ("y + 1", "syntax:unknown_name"),
    ("2*x +", "syntax:unparseable"),
    ("", "syntax:empty"),
])
def test_untrusted_expressions_are_rejected_before_sympy(expression: str, code: str) -> None:
    ok, check = _last("derivative", f"Differentiate {expression}.", "1",
                      {"function": expression, "variable": "x"})
    assert (ok, check) == (False, code)


def test_renumber_changes_numbers_and_the_answer_follows() -> None:
    rng = random.Random(3)
    params = {"var": "x", "a": 2, "b": 3, "c": 0, "p": 4, "q": 1, "paren": False}
    new, detail = adversarial.renumber(params, rng)
    assert detail["changed"] and new != params
    built = TOPICS["linear"].build(new)
    trail = verify("linear", built.question, built.answer, built.problem)
    assert trail[-1].ok
    assert adversarial.rename(params, rng)[0]["var"] != "x"
    with pytest.raises(adversarial.NotApplicable):
        adversarial.rename({"op": "gcd", "numbers": [4, 6]}, rng)
