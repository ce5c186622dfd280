"""Output comparison and rewards (pure functions: no sandbox)."""

from __future__ import annotations

from workers.sandbox.scoring import compare_output, score
from workers.sandbox.spec import CaseResult, ExecutionResult, Status


def test_exact_comparison_ignores_trailing_whitespace_only() -> None:
    assert compare_output("1 2\n3\n\n", "1 2\n3")
    assert compare_output("a  \r\nb", "a\nb")
    assert not compare_output("1  2", "1 2")
    assert not compare_output("1\n2", "1 2")


def test_tolerant_comparison_accepts_close_numbers_and_any_spacing() -> None:
    assert compare_output("0.3333333\n", "0.33333334", tolerant=True)
    assert compare_output("1   2\n3", "1 2 3", tolerant=True)
    assert not compare_output("0.34", "0.33", tolerant=True)
    assert not compare_output("1 2", "1 2 3", tolerant=True)
    assert not compare_output("abc", "abd", tolerant=True)
    assert compare_output("nan", "nan", tolerant=True)


def test_score_is_the_share_of_cases_passed() -> None:
    cases = [CaseResult(status=Status.OK, passed=True), CaseResult(status=Status.RE)]
    assert score(ExecutionResult(status=Status.RE, cases=cases)) == 0.5


def test_score_needs_the_nonce_verdict_for_tests() -> None:
    assert score(ExecutionResult(status=Status.OK, tests_passed=True)) == 1.0
    assert score(ExecutionResult(status=Status.OK, tests_passed=False)) == 0.0
    assert score(ExecutionResult(status=Status.TLE)) == 0.0
