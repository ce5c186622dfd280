"""Scoring helpers: output comparison, stdin/stdout cases, assert tests, HumanEval checks.

A reward is a fraction of tests passed. Unit-test verdicts come only from the test driver's keyed
record (ExecutionResult.tests_passed): the driver runs in a sandbox of its own and compares on
plain data, so a program that exits 0, prints "PASSED", returns an object whose `__eq__` always
holds or writes forged records scores zero. Stdin/stdout cases are compared by the supervisor on
the bytes it captured, and a case passes only if the program also exited 0 (per the status
waiter's keyed record).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .spec import CallCase, ExecutionRequest, ExecutionResult, Limits, StdioCase

if TYPE_CHECKING:  # the runner imports this module; avoid the cycle at run time
    from .runner import Engine


def _tokens(text: str) -> list[str]:
    return text.split()


def _close(a: str, b: str, abs_tol: float, rel_tol: float) -> bool:
    if a == b:
        return True
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    return math.isclose(x, y, rel_tol=rel_tol, abs_tol=abs_tol)


def compare_output(
    actual: str, expected: str, *, tolerant: bool = False, abs_tol: float = 1e-6,
    rel_tol: float = 1e-6,
) -> bool:
    """Exact: equal after stripping trailing whitespace per line and trailing blank lines.
    Tolerant: equal as whitespace-separated tokens, numbers within the tolerances."""
    if not tolerant:
        def norm(text: str) -> list[str]:
            lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
            while lines and not lines[-1]:
                lines.pop()
            return lines

        return norm(actual) == norm(expected)
    got, want = _tokens(actual), _tokens(expected)
    return len(got) == len(want) and all(
        _close(g, w, abs_tol, rel_tol) for g, w in zip(got, want, strict=True)
    )


def values_equal(
    got: Any, expected: Any, *, tolerant: bool = False, abs_tol: float = 1e-6,
    rel_tol: float = 1e-6,
) -> bool:
    """A call's plain-data result against its expected JSON value: numbers by value (an int and
    a float may be equal; with `tolerant` floats within the tolerances, NaN equal to NaN), bools
    only with bools, strings exactly, tuples as lists (JSON has no tuples), lists and dicts
    element by element. Both sides are builtin values here, so nothing the candidate defined
    takes part in the comparison."""
    if isinstance(got, bool) or isinstance(expected, bool):
        return type(got) is bool and type(expected) is bool and got is expected
    if isinstance(got, int | float) and isinstance(expected, int | float):
        if isinstance(got, float) and isinstance(expected, float) and math.isnan(got):
            return math.isnan(expected)
        if tolerant:
            return math.isclose(got, expected, rel_tol=rel_tol, abs_tol=abs_tol)
        return got == expected
    if isinstance(got, tuple):
        got = list(got)
    if isinstance(expected, tuple):
        expected = list(expected)
    if isinstance(got, list) and isinstance(expected, list):
        return len(got) == len(expected) and all(
            values_equal(g, e, tolerant=tolerant, abs_tol=abs_tol, rel_tol=rel_tol)
            for g, e in zip(got, expected, strict=True))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(
            values_equal(got[k], expected[k], tolerant=tolerant, abs_tol=abs_tol,
                         rel_tol=rel_tol) for k in got)
    if type(got) is not type(expected):
        return False
    return bool(got == expected)


def calls_request(
    language: str, code: str, calls: Sequence[CallCase], limits: Limits | None = None
) -> ExecutionRequest:
    """Function calls graded by value by the supervisor (any language with a call server)."""
    return ExecutionRequest(language=language, code=code, calls=list(calls),
                            limits=limits or Limits())


def stdio_request(
    language: str, code: str, cases: Sequence[StdioCase], limits: Limits | None = None
) -> ExecutionRequest:
    """A request that compiles once and runs every stdin/stdout case in its own sandbox."""
    return ExecutionRequest(language=language, code=code, cases=list(cases),
                            limits=limits or Limits())


def assert_request(
    language: str, code: str, tests: str, limits: Limits | None = None,
    grader_key: str | None = None,
) -> ExecutionRequest:
    """Assert-style function tests (python, javascript): a test driver in a sandbox of its own
    runs them against the candidate's functions by value; they pass only if they run to their
    end."""
    return ExecutionRequest(language=language, code=code, tests=tests, limits=limits or Limits(),
                            grader_key=grader_key)


def humaneval_request(
    prompt: str, completion: str, test: str, entry_point: str, limits: Limits | None = None,
    grader_key: str | None = None,
) -> ExecutionRequest:
    """A HumanEval-style check: the candidate is prompt + completion; the driver runs the prompt
    itself (trusted: its helpers, such as `poly`, are the task's, whatever the candidate
    redefines), then `check(entry_point)` with the entry point bound to the candidate's."""
    return ExecutionRequest(
        language="python", code=prompt + completion, test_prelude=prompt,
        entry_points=[entry_point], tests=f"{test}\n\ncheck({entry_point})\n",
        limits=limits or Limits(wall_ms=10_000), grader_key=grader_key,
    )


def score(result: ExecutionResult) -> float:
    """Reward in [0, 1]: share of stdin/stdout cases or of calls passed, else 1.0 only for a
    verified pass."""
    if result.cases:
        return sum(c.passed for c in result.cases) / len(result.cases)
    if result.calls:
        return sum(c.passed for c in result.calls) / len(result.calls)
    return 1.0 if result.passed else 0.0


def score_batch(
    engine: Engine, requests: Sequence[ExecutionRequest], concurrency: int = 2
) -> list[float]:
    """Scores of many requests executed with a concurrency limit."""
    return [score(r) for r in engine.execute_batch(requests, concurrency=concurrency)]
