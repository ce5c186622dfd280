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
from typing import TYPE_CHECKING

from .spec import ExecutionRequest, ExecutionResult, Limits, StdioCase

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


def stdio_request(
    language: str, code: str, cases: Sequence[StdioCase], limits: Limits | None = None
) -> ExecutionRequest:
    """A request that compiles once and runs every stdin/stdout case in its own sandbox."""
    return ExecutionRequest(language=language, code=code, cases=list(cases),
                            limits=limits or Limits())


def assert_request(
    language: str, code: str, tests: str, limits: Limits | None = None
) -> ExecutionRequest:
    """Assert-style function tests (python, javascript): a test driver in a sandbox of its own
    runs them against the candidate's functions by value; they pass only if they run to their
    end."""
    return ExecutionRequest(language=language, code=code, tests=tests, limits=limits or Limits())


def humaneval_request(
    prompt: str, completion: str, test: str, entry_point: str, limits: Limits | None = None
) -> ExecutionRequest:
    """A HumanEval-style check: the candidate is prompt + completion; the driver runs the prompt
    itself (trusted: its helpers, such as `poly`, are the task's, whatever the candidate
    redefines), then `check(entry_point)` with the entry point bound to the candidate's."""
    return ExecutionRequest(
        language="python", code=prompt + completion, test_prelude=prompt,
        entry_points=[entry_point], tests=f"{test}\n\ncheck({entry_point})\n",
        limits=limits or Limits(wall_ms=10_000),
    )


def score(result: ExecutionResult) -> float:
    """Reward in [0, 1]: share of stdin/stdout cases passed, else 1.0 only for a verified pass."""
    if result.cases:
        return sum(c.passed for c in result.cases) / len(result.cases)
    return 1.0 if result.passed else 0.0


def score_batch(
    engine: Engine, requests: Sequence[ExecutionRequest], concurrency: int = 2
) -> list[float]:
    """Scores of many requests executed with a concurrency limit."""
    return [score(r) for r in engine.execute_batch(requests, concurrency=concurrency)]
