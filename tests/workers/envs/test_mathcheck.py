"""Symbolic answer checking (pure functions)."""

from __future__ import annotations

import pytest

from workers.envs.mathcheck import equivalent, extract_answer, extract_boxed, perturbations


@pytest.mark.parametrize("pred", ["1/2", "0.5", "\\frac{1}{2}", "\\frac12", "2/4", ".5",
                                  "\\dfrac{1}{2}"])
def test_one_half_in_every_spelling(pred: str) -> None:
    for gold in ("1/2", "0.5", "\\frac{1}{2}"):
        assert equivalent(pred, gold), (pred, gold)


@pytest.mark.parametrize(("pred", "gold"), [
    ("x + 1", "1 + x"), ("\\sqrt{2}/2", "1/\\sqrt{2}"), ("3.0", "3"), ("1,000", "1000"),
    ("-\\frac{3}{4}", "-0.75"),
])
def test_equal_forms(pred: str, gold: str) -> None:
    assert equivalent(pred, gold)


@pytest.mark.parametrize(("pred", "gold"), [
    ("2", "1/2"), ("-4", "4"), ("I don't know", "1/2"), ("nope", "1/2"), ("41", "4"),
    ("", "1"), ("0.51", "1/2"), ("x", "y"),
    ("10^{10^{10}}", "5"),  # refused before sympy could spend minutes on it
])
def test_different_answers(pred: str, gold: str) -> None:
    assert not equivalent(pred, gold)


def test_extraction() -> None:
    assert extract_boxed("so \\boxed{\\frac{1}{2}} and \\boxed{3}") == "3"
    assert extract_boxed("\\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert extract_boxed("\\boxed{unclosed") is None
    assert extract_answer("Work...\nThe answer is $0.5$.") == "0.5"
    assert extract_answer("Answer: 12") == "12"
    assert extract_answer("lots\nof\n7") == "7"
    assert extract_answer("   ") == ""


def test_perturbations_are_all_wrong() -> None:
    assert perturbations("42") == ["-42", "43", "84", "421"]
    assert perturbations("1/2") == ["-1/2", "1", "3/2"]
    assert perturbations("0") == ["-1", "1", "01"]
    assert perturbations("\\sqrt{2}") == []
    for gold in ("42", "1/2", "0", "-3"):
        assert not any(equivalent(p, gold) for p in perturbations(gold))
