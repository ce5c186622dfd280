"""Reward components by name: the checkers an uploaded rubric may use, and the code runner.

Each checker is a batched `ComponentFn` returning (value in [0, 1], info) per completion. Code
checkers send the whole batch to the sandbox engine at once (`execute_batch`), so a rubric over
164 HumanEval completions costs one parallel batch, not 164 round trips.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from workers.envs import mathcheck
from workers.envs.base import Component, ComponentFn, EnvTask, InfraError
from workers.envs.checker_params import (
    PARTIAL_PARAMS,
    AnswerParams,
    JsonFieldParams,
    NumericParams,
    RegexParams,
    SimilarityParams,
    WeightedParams,
    parse_params,
)
from workers.envs.spec import CHECKERS, ComponentSpec
from workers.sandbox.scoring import calls_request, humaneval_request, score, stdio_request
from workers.sandbox.spec import (
    CallCase,
    ExecutionRequest,
    ExecutionResult,
    Limits,
    Status,
    StdioCase,
)

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


def grader_key(owner: str) -> str:
    """A key of its own for one environment instance: its tasks' tests (one author) may share a
    test driver's zygote (`ExecutionRequest.grader_key`); no other environment's ever do."""
    return f"{owner}-{secrets.token_hex(8)}"


def code_request(
    task: EnvTask, completion: str, limits: Limits, key: str | None = None
) -> ExecutionRequest:
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
            return humaneval_request(task.prompt + "\n\n", code, task.tests, entry, limits,
                                     grader_key=key)
        return humaneval_request(task.prompt, completion, task.tests, entry, limits,
                                 grader_key=key)
    return ExecutionRequest(language="python", code=extract_code(completion), tests=task.tests,
                            limits=limits, grader_key=key)


def stdio_cases_request(
    task: EnvTask, completion: str, limits: Limits, language: str = "python"
) -> ExecutionRequest:
    cases = [StdioCase(**c) for c in task.metadata.get("cases", [])]
    if not cases:
        raise ValueError(f"task {task.id!r} has no stdin/stdout cases")
    return stdio_request(language, extract_code(completion), cases, limits)


def call_cases_request(
    task: EnvTask, completion: str, limits: Limits, language: str = "python"
) -> ExecutionRequest:
    calls = [CallCase(**c) for c in task.metadata.get("calls", [])]
    if not calls:
        raise ValueError(f"task {task.id!r} has no calls for the call_cases checker")
    return calls_request(language, extract_code(completion), calls, limits)


def execution_info(result: ExecutionResult) -> dict[str, Any]:
    """What QC, feedback turns and the run's verdict counts need from an execution: status,
    how the verdict was reached (workers.sandbox.spec.VERDICTS) and the failure text (the
    candidate's own output and the grader's reason; never the hidden tests)."""
    failed = next((c for c in result.cases if not c.passed), None)
    head = failed or result
    text = "\n".join(p for p in (head.message, head.stderr.strip(), head.stdout.strip()) if p)
    if failed is not None and failed.status == "OK":
        text = "wrong output on a test case" + (f"\n{text}" if text else "")
    info = {"status": str(result.status), "wall_ms": result.wall_ms,
            "verdict": result.verdict or ("passed" if result.passed else "failed"),
            "feedback": text[-FEEDBACK_CHARS:]}
    reason = infra_failure(result)
    if reason is not None:
        info["infra"] = reason
    return info


def infra_failure(result: ExecutionResult) -> str | None:
    """Why the sandbox engine, not the program, decided this result (a SANDBOX_ERROR of the
    whole execution or of any stdin/stdout case: its score says nothing about the completion);
    None when the program's own behaviour did."""
    if result.status == Status.SANDBOX_ERROR:
        return result.message or "sandbox error"
    broken = next((c for c in result.cases if c.status == Status.SANDBOX_ERROR), None)
    if broken is not None:
        return broken.message or "sandbox error in a test case"
    return None


def raise_if_infra(info: Mapping[str, Any]) -> None:
    """In `respond`: a sandbox failure ends the episode as infra instead of becoming the
    model's feedback."""
    if info.get("infra"):
        raise InfraError(f"the sandbox failed: {info['infra']}")


def unit_tests(sandbox: Sandbox, limits: Limits, key: str | None = None) -> ComponentFn:
    """Unit tests in the test driver; `key` (grader_key) lets the environment's executions
    share a forking driver."""
    def fn(tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[tuple[float, dict]]:
        results = sandbox.run([code_request(t, c, limits, key)
                               for t, c in zip(tasks, completions, strict=True)])
        return [(score(r), execution_info(r)) for r in results]
    return fn


def stdio_cases(sandbox: Sandbox, limits: Limits, language: str) -> ComponentFn:
    def fn(tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[tuple[float, dict]]:
        results = sandbox.run([stdio_cases_request(t, c, limits, language)
                               for t, c in zip(tasks, completions, strict=True)])
        return [(score(r), execution_info(r)) for r in results]
    return fn


def call_cases(sandbox: Sandbox, limits: Limits, language: str) -> ComponentFn:
    def fn(tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[tuple[float, dict]]:
        results = sandbox.run([call_cases_request(t, c, limits, language)
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


# -- partial credit ------------------------------------------------------------------------------
# Config-only checkers whose value can lie strictly between 0 and 1. Params are typed (and
# validated at registration) in checker_params.py; each says where it reads the answer.

def answer_text(completion: str, params: AnswerParams) -> str | None:
    """The model's answer as `params` locate it; None when a `pattern` does not match."""
    if params.pattern is not None:
        found = None
        for found in re.finditer(params.pattern, completion, re.DOTALL):  # noqa: B007
            pass
        if found is None:
            return None
        if "answer" in found.re.groupindex:
            return found.group("answer") or ""
        return (found.group(1) or "") if found.re.groups else found.group(0)
    if params.extract == "raw":
        return completion.strip()
    return mathcheck.extract_answer(completion)


def patterns_share(params: RegexParams) -> ComponentFn:
    """Share of the patterns the completion matches (one pattern: 1 or 0)."""
    compiled = [re.compile(p, re.DOTALL) for p in params.all_patterns()]

    def hit(rx: re.Pattern[str], text: str) -> bool:
        return bool(rx.fullmatch(text.strip()) if params.fullmatch else rx.search(text))

    def fn(tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[tuple[float, dict]]:
        return [(sum(hit(rx, c) for rx in compiled) / len(compiled), {}) for c in completions]
    return fn


def similarity(metric: str, params: SimilarityParams) -> ComponentFn:
    """`lcs_ratio`: 2·LCS/(|a|+|b|), rapidfuzz's normalised Indel similarity (the Indel
    distance is |a|+|b|-2·LCS); `edit_distance`: 1 - Levenshtein/max(|a|,|b|). Both compare the
    normalised answer with the normalised `answer`; an empty completion scores 0."""
    from rapidfuzz.distance import Indel, Levenshtein

    scorer = Indel.normalized_similarity if metric == "lcs_ratio" else \
        Levenshtein.normalized_similarity

    def fn(tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[tuple[float, dict]]:
        golds = _answers(tasks, metric)
        out: list[tuple[float, dict]] = []
        for gold, completion in zip(golds, completions, strict=True):
            got = answer_text(completion, params) if completion.strip() else None
            if got is None:
                out.append((0.0, {"extracted": None}))
                continue
            a = normalise_text(got, params.case_sensitive)
            b = normalise_text(gold, params.case_sensitive)
            out.append((float(scorer(a, b)), {"extracted": got[:200]}))
        return out
    return fn


_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][-+]?\d+)?"
                     r"(?:\s*/\s*\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?")


def parse_number(text: str) -> Fraction | None:
    """An exact number: the whole text (`3/4`, `-2.5`, `1e5`), else the last number in it
    (thousands separators allowed: `1,234`). Exact fractions, so tolerances bind exactly."""
    for candidate in (text.strip(), *reversed(_NUMBER.findall(text))):
        try:
            return Fraction(candidate.replace(",", "").replace(" ", ""))
        except (ValueError, ZeroDivisionError):
            continue
    return None


def numeric_answers(tasks: Sequence[EnvTask]) -> list[Fraction]:
    """Each task's `answer` as a number; a ValueError names the tasks whose answer is not."""
    golds = _answers(tasks, "numeric")
    parsed = []
    for task, gold in zip(tasks, golds, strict=True):
        try:
            parsed.append(Fraction(gold.strip().replace(",", "")))
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"checker 'numeric': task {task.id!r} has answer {gold[:40]!r}, "
                             "which is not a number") from None
    return parsed


def numeric(params: NumericParams) -> ComponentFn:
    """1 within max(abs_tol, rel_tol·|answer|); with `scale`, linear falloff to 0 at `scale`
    past the tolerance."""
    abs_tol, rel_tol = Fraction(params.abs_tol), Fraction(params.rel_tol)
    scale = Fraction(params.scale) if params.scale is not None else None

    def fn(tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[tuple[float, dict]]:
        out: list[tuple[float, dict]] = []
        for gold, completion in zip(numeric_answers(tasks), completions, strict=True):
            got = answer_text(completion, params) if completion.strip() else None
            value = parse_number(got) if got is not None else None
            if value is None:
                out.append((0.0, {"extracted": None}))
                continue
            error, tol = abs(value - gold), max(abs_tol, rel_tol * abs(gold))
            if error <= tol:
                credit = 1.0
            elif scale is not None:
                credit = max(0.0, float(1 - (error - tol) / scale))
            else:
                credit = 0.0
            out.append((credit, {"extracted": (got or "")[:200], "error": float(error)}))
        return out
    return fn


_JSON_FENCE = re.compile(r"```[ \t]*(?:json)?[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)
_MISSING = object()


def json_object(text: str) -> dict[str, Any] | None:
    """The completion's JSON object: its last fenced block, else its first `{` to last `}`."""
    candidates = _JSON_FENCE.findall(text)[-1:]
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        candidates.append(text[start:end + 1])
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def json_at(value: Any, path: str) -> Any:
    """The value at a dotted path (list items by index), or `_MISSING`."""
    for part in path.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return _MISSING
    return value


def json_equal(a: Any, b: Any, case_sensitive: bool) -> bool:
    """Equal JSON values: numbers by value (1 == 1.0, never a boolean), strings per
    `case_sensitive`, arrays and objects member by member."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, str) and isinstance(b, str):
        return a == b if case_sensitive else normalise_text(a) == normalise_text(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y, case_sensitive)
                                        for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k], case_sensitive) for k in a)
    return a is None and b is None


def json_answers(tasks: Sequence[EnvTask], params: JsonFieldParams
                 ) -> list[tuple[dict[str, Any], list[str]]]:
    """Each task's answer object and the fields scored; a ValueError names a task whose
    answer is not a JSON object or lacks a field."""
    out = []
    for task, gold in zip(tasks, _answers(tasks, "json_field"), strict=True):
        try:
            value = json.loads(gold)
        except ValueError:
            value = None
        if not isinstance(value, dict) or not value:
            raise ValueError(f"checker 'json_field': task {task.id!r} has an answer that is "
                             "not a non-empty JSON object")
        fields = list(params.fields) if params.fields is not None else sorted(value)
        missing = [f for f in fields if json_at(value, f) is _MISSING]
        if missing:
            raise ValueError(f"checker 'json_field': task {task.id!r}'s answer has no field "
                             f"{missing[0]!r}")
        out.append((value, fields))
    return out


def json_field(params: JsonFieldParams) -> ComponentFn:
    def fn(tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[tuple[float, dict]]:
        out: list[tuple[float, dict]] = []
        for (gold, fields), completion in zip(json_answers(tasks, params), completions,
                                              strict=True):
            got = json_object(completion)
            if got is None:
                out.append((0.0, {"json": "no JSON object in the completion"}))
                continue
            right = [f for f in fields if (v := json_at(got, f)) is not _MISSING
                     and json_equal(v, json_at(gold, f), params.case_sensitive)]
            out.append((len(right) / len(fields), {"fields_matched": len(right)}))
        return out
    return fn


def weighted(parts: Sequence[Component]) -> ComponentFn:
    """Σ weight·value / Σ weight over the parts, in one call of each part on the batch."""
    total = sum(p.weight for p in parts)

    def fn(tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[tuple[float, dict]]:
        values = [0.0] * len(completions)
        infos: list[dict[str, Any]] = [{"parts": {}} for _ in completions]
        for part in parts:
            for i, (value, info) in enumerate(part.fn(tasks, completions)):
                values[i] += part.weight * float(value)
                infos[i]["parts"][part.name] = float(value)
                for key, item in info.items():
                    infos[i].setdefault(key, item)
        return [(v / total, info) for v, info in zip(values, infos, strict=True)]
    return fn


def graded(checker: str, typed: Any) -> bool:
    """Whether a checker can give values strictly between 0 and 1 (partial credit): QC then
    lets a trivial answer earn a bounded share instead of nothing."""
    if checker in ("lcs_ratio", "edit_distance"):
        return True
    if checker == "numeric":
        return typed.scale is not None
    if checker == "json_field":
        return typed.fields is None or len(typed.fields) > 1
    if checker == "regex":
        return len(typed.all_patterns()) > 1
    return False


def _partial_component(spec: ComponentSpec, sandbox: Sandbox, limits: Limits) -> Component:
    """A component of a checker typed in checker_params.py."""
    typed = parse_params(spec.checker, spec.params)
    fn: ComponentFn
    is_graded = graded(spec.checker, typed)
    if isinstance(typed, WeightedParams):
        parts = [build_component(ComponentSpec(name=f"part{i}_{p.checker}", checker=p.checker,
                                               weight=p.weight, params=p.params),
                                 sandbox, limits)
                 for i, p in enumerate(typed.checkers)]
        fn = weighted(parts)
        is_graded = any(p.graded for p in parts) or sum(p.weight > 0 for p in parts) > 1
    elif isinstance(typed, SimilarityParams):
        fn = similarity(spec.checker, typed)
    elif isinstance(typed, NumericParams):
        fn = numeric(typed)
    elif isinstance(typed, JsonFieldParams):
        fn = json_field(typed)
    elif isinstance(typed, RegexParams):
        fn = patterns_share(typed)
    else:  # PARTIAL_PARAMS and this dispatch list the same checkers
        raise ValueError(f"checker {spec.checker!r} has no partial-credit scorer")
    return Component(name=spec.name, weight=spec.weight, fn=fn, kind=spec.checker,
                     params=dict(spec.params), graded=is_graded)


def build_component(
    spec: ComponentSpec, sandbox: Sandbox, limits: Limits, key: str | None = None
) -> Component:
    """A rubric component from its spec; unknown params are an error naming them."""
    if spec.checker in PARTIAL_PARAMS:
        return _partial_component(spec, sandbox, limits)
    params: Mapping[str, Any] = spec.params
    allowed = {"exact_match": {"case_sensitive"}, "contains": {"case_sensitive"},
               "stdio_cases": {"language"}, "call_cases": {"language"},
               "math_equiv": set(),
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
    elif spec.checker == "math_equiv":
        fn = math_equiv()
    elif spec.checker == "unit_tests":
        fn = unit_tests(sandbox, limits, key)
    elif spec.checker == "stdio_cases":
        fn = stdio_cases(sandbox, limits, str(params.get("language", "python")))
    elif spec.checker == "call_cases":
        fn = call_cases(sandbox, limits, str(params.get("language", "python")))
    else:  # the spec validator keeps this unreachable; say so if it is not
        raise ValueError(f"unknown checker {spec.checker!r}; known: {sorted(CHECKERS)}")
    return Component(name=spec.name, weight=spec.weight, fn=fn, kind=spec.checker,
                     params=dict(params))
