"""Reward components by name: the checkers an uploaded rubric may use, and the code runner.

Each checker is a batched `ComponentFn` returning (value in [0, 1], info) per completion. Code
checkers send the whole batch to the sandbox engine at once (`execute_batch`), so a rubric over
164 HumanEval completions costs one parallel batch, not 164 round trips.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from workers.envs import mathcheck
from workers.envs.base import Component, ComponentFn, EnvTask
from workers.envs.spec import CHECKERS, ComponentSpec
from workers.sandbox.scoring import humaneval_request, score, stdio_request
from workers.sandbox.spec import ExecutionRequest, ExecutionResult, Limits, StdioCase

if TYPE_CHECKING:
    from workers.sandbox.runner import Engine

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)
FEEDBACK_CHARS = 2_000


def extract_code(completion: str) -> str:
    """The last fenced code block, else the whole completion."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def normalise_text(text: str, case_sensitive: bool = False) -> str:
    text = " ".join(text.split())
    return text if case_sensitive else text.lower()


class Sandbox:
    """The sandbox engine an environment's code checkers use (the process-wide one unless
    given), and how many executions run at once."""

    def __init__(self, engine: Engine | None = None, concurrency: int = 2) -> None:
        self._engine = engine
        self.concurrency = concurrency
        self._lock = threading.Lock()

    @property
    def engine(self) -> Engine:
        with self._lock:
            if self._engine is None:
                from workers.sandbox.runner import default_engine

                self._engine = default_engine()
            return self._engine

    def run(self, requests: Sequence[ExecutionRequest]) -> list[ExecutionResult]:
        return self.engine.execute_batch(requests, concurrency=self.concurrency)


def code_request(task: EnvTask, completion: str, limits: Limits) -> ExecutionRequest:
    """The program that checks a code completion against the task's tests.

    HumanEval-style tasks (`metadata.entry_point`): a completion that defines the entry point
    (a chat answer) runs after the prompt (its imports and helpers), anything else continues
    the prompt; then `check(entry_point)`. Plain tasks: the code, then the assert tests."""
    entry = task.metadata.get("entry_point")
    if task.tests is None:
        raise ValueError(f"task {task.id!r} has no tests for the unit_tests checker")
    if entry:
        code = extract_code(completion)
        if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
            return humaneval_request(task.prompt + "\n\n", code, task.tests, entry, limits)
        return humaneval_request(task.prompt, completion, task.tests, entry, limits)
    return ExecutionRequest(language="python", code=extract_code(completion), tests=task.tests,
                            limits=limits)


def stdio_cases_request(
    task: EnvTask, completion: str, limits: Limits, language: str = "python"
) -> ExecutionRequest:
    cases = [StdioCase(**c) for c in task.metadata.get("cases", [])]
    if not cases:
        raise ValueError(f"task {task.id!r} has no stdin/stdout cases")
    return stdio_request(language, extract_code(completion), cases, limits)


def execution_info(result: ExecutionResult) -> dict[str, Any]:
    """What QC, feedback turns and the run's verdict counts need from an execution: status,
    how the verdict was reached (workers.sandbox.spec.VERDICTS) and the failure text (the
    candidate's own output and the grader's reason; never the hidden tests)."""
    failed = next((c for c in result.cases if not c.passed), None)
    head = failed or result
    text = "\n".join(p for p in (head.message, head.stderr.strip(), head.stdout.strip()) if p)
    if failed is not None and failed.status == "OK":
        text = "wrong output on a test case" + (f"\n{text}" if text else "")
    return {"status": str(result.status), "wall_ms": result.wall_ms,
            "verdict": result.verdict or ("passed" if result.passed else "failed"),
            "feedback": text[-FEEDBACK_CHARS:]}


def unit_tests(sandbox: Sandbox, limits: Limits) -> ComponentFn:
    def fn(tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[tuple[float, dict]]:
        results = sandbox.run([code_request(t, c, limits) for t, c in zip(tasks, completions,
                                                                           strict=True)])
        return [(score(r), execution_info(r)) for r in results]
    return fn


def stdio_cases(sandbox: Sandbox, limits: Limits, language: str) -> ComponentFn:
    def fn(tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[tuple[float, dict]]:
        results = sandbox.run([stdio_cases_request(t, c, limits, language)
                               for t, c in zip(tasks, completions, strict=True)])
        return [(score(r), execution_info(r)) for r in results]
    return fn


def _answers(tasks: Sequence[EnvTask], checker: str) -> list[str]:
    missing = [t.id for t in tasks if t.answer is None]
    if missing:
        raise ValueError(f"checker {checker!r} needs an answer; tasks without one: {missing[:5]}")
    return [t.answer or "" for t in tasks]


def exact_match(case_sensitive: bool = False) -> ComponentFn:
    def fn(tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[tuple[float, dict]]:
        golds = _answers(tasks, "exact_match")
        return [(float(bool(c.strip()) and normalise_text(mathcheck.extract_answer(c),
                                                          case_sensitive)
                       == normalise_text(g, case_sensitive)), {})
                for g, c in zip(golds, completions, strict=True)]
    return fn


def math_equiv() -> ComponentFn:
    def fn(tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[tuple[float, dict]]:
        golds = _answers(tasks, "math_equiv")
        out = []
        for gold, completion in zip(golds, completions, strict=True):
            pred = mathcheck.extract_answer(completion)
            out.append((float(mathcheck.equivalent(pred, gold)), {"extracted": pred[:200]}))
        return out
    return fn


def contains(case_sensitive: bool = False) -> ComponentFn:
    def fn(tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[tuple[float, dict]]:
        golds = _answers(tasks, "contains")
        return [(float(bool(g.strip()) and normalise_text(g, case_sensitive)
                       in normalise_text(c, case_sensitive)), {})
                for g, c in zip(golds, completions, strict=True)]
    return fn


def regex(pattern: str) -> ComponentFn:
    compiled = re.compile(pattern, re.DOTALL)

    def fn(tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[tuple[float, dict]]:
        return [(float(bool(compiled.search(c))), {}) for c in completions]
    return fn


def build_component(spec: ComponentSpec, sandbox: Sandbox, limits: Limits) -> Component:
    """A rubric component from its spec; unknown params are an error naming them."""
    params: Mapping[str, Any] = spec.params
    allowed = {"exact_match": {"case_sensitive"}, "contains": {"case_sensitive"},
               "regex": {"pattern"}, "stdio_cases": {"language"}, "math_equiv": set(),
               "unit_tests": set()}[spec.checker]
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ValueError(f"component {spec.name!r}: checker {spec.checker!r} takes no params "
                         f"{unknown} (allowed: {sorted(allowed) or 'none'})")
    fn: ComponentFn
    if spec.checker == "exact_match":
        fn = exact_match(bool(params.get("case_sensitive", False)))
    elif spec.checker == "contains":
        fn = contains(bool(params.get("case_sensitive", False)))
    elif spec.checker == "regex":
        if not isinstance(params.get("pattern"), str):
            raise ValueError(f"component {spec.name!r}: regex needs params.pattern (a string)")
        try:
            fn = regex(params["pattern"])
        except re.error as exc:
            raise ValueError(f"component {spec.name!r}: bad pattern: {exc}") from exc
    elif spec.checker == "math_equiv":
        fn = math_equiv()
    elif spec.checker == "unit_tests":
        fn = unit_tests(sandbox, limits)
    elif spec.checker == "stdio_cases":
        fn = stdio_cases(sandbox, limits, str(params.get("language", "python")))
    else:  # the spec validator keeps this unreachable; say so if it is not
        raise ValueError(f"unknown checker {spec.checker!r}; known: {sorted(CHECKERS)}")
    return Component(name=spec.name, weight=spec.weight, fn=fn, kind=spec.checker,
                     params=dict(params))
