"""Typed params of the partial-credit checkers an uploaded rubric may name.

Pure pydantic and the standard library (the control plane validates a registration with it):
a bad param is refused when the version is registered, with a message naming it, not when QC or
a training run first loads the environment. The scoring functions are in `checkers.py`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_PATTERN_CHARS = 1_000
MAX_WEIGHTED_PARTS = 8


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _compile(pattern: str) -> re.Pattern[str]:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"a pattern is at most {MAX_PATTERN_CHARS} characters")
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as exc:
        raise ValueError(f"bad pattern {pattern[:80]!r}: {exc}") from exc


class AnswerParams(_Params):
    """Where a checker reads the model's answer. `extract`: `answer` (the last `\\boxed{}`,
    else an `Answer: ...` line, else the last line, as exact_match does) or `raw` (the whole
    completion, stripped). `pattern`: a regex whose last match gives the answer: its group
    named `answer`, else its first group, else the whole match; no match scores 0."""

    extract: Literal["answer", "raw"] = "answer"
    pattern: str | None = None

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, value: str | None) -> str | None:
        if value is not None:
            _compile(value)
        return value


class SimilarityParams(AnswerParams):
    """`lcs_ratio` and `edit_distance`: compared after whitespace runs are collapsed, and
    lowercased unless `case_sensitive` (as exact_match compares), so exactly the answers
    exact_match accepts score 1."""

    case_sensitive: bool = False


class NumericParams(AnswerParams):
    """`numeric`: 1 within max(abs_tol, rel_tol x |answer|) of the task's answer. With
    `scale`, credit then falls linearly to 0 at `scale` beyond the tolerance (partial credit);
    without it, anything outside scores 0."""

    abs_tol: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.0
    rel_tol: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.0
    scale: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None


class JsonFieldParams(_Params):
    """`json_field`: the task's answer is a JSON object; the completion's JSON object (its
    last fenced ```json block, else the span from its first `{` to its last `}`) scores the
    share of `fields` (dotted paths; default: every top-level key of the answer) whose values
    equal the answer's. Numbers compare by value (1 == 1.0); strings exactly unless
    `case_sensitive` is false (then after whitespace collapsing and lowercasing)."""

    fields: Annotated[list[Annotated[str, Field(min_length=1, max_length=200)]],
                      Field(max_length=64)] | None = None
    case_sensitive: bool = True

    @field_validator("fields")
    @classmethod
    def _fields(cls, value: list[str] | None) -> list[str] | None:
        if value is not None:
            if not value:
                raise ValueError("fields must name at least one field (or be left out)")
            bad = [f for f in value if any(not part for part in f.split("."))]
            if bad:
                raise ValueError(f"field paths are dotted keys like 'a.b'; bad: {bad[:3]}")
            if len(set(value)) != len(value):
                raise ValueError("fields must be distinct")
        return value


class RegexParams(_Params):
    """`regex`: 1 if the completion matches `pattern` (re.search; `fullmatch` for the whole
    stripped completion); with `patterns`, the share of them that match (a graded format
    rubric)."""

    pattern: str | None = None
    patterns: Annotated[list[str], Field(min_length=1, max_length=32)] | None = None
    fullmatch: bool = False

    @model_validator(mode="after")
    def _check(self) -> RegexParams:
        if (self.pattern is None) == (self.patterns is None):
            raise ValueError("regex needs exactly one of params.pattern (a string) or "
                             "params.patterns (a list of strings)")
        for p in self.all_patterns():
            _compile(p)
        return self

    def all_patterns(self) -> list[str]:
        return [self.pattern] if self.pattern is not None else list(self.patterns or [])


class WeightedPart(_Params):
    checker: str
    weight: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0
    params: dict[str, Any] = Field(default_factory=dict)


class WeightedParams(_Params):
    """`weighted`: Σ weight x value / Σ weight over `checkers` (each a checker name, weight
    and params; not `weighted` itself): one component in [0, 1] made of several."""

    checkers: Annotated[list[WeightedPart], Field(min_length=1, max_length=MAX_WEIGHTED_PARTS)]

    @model_validator(mode="after")
    def _check(self) -> WeightedParams:
        if not any(p.weight > 0 for p in self.checkers):
            raise ValueError("weighted needs at least one part with a positive weight")
        for i, part in enumerate(self.checkers):
            if part.checker == "weighted":
                raise ValueError(f"checkers.{i}: a weighted part cannot itself be weighted "
                                 "(list its parts here instead)")
        return self


PARTIAL_PARAMS: dict[str, type[_Params]] = {
    "lcs_ratio": SimilarityParams,
    "edit_distance": SimilarityParams,
    "numeric": NumericParams,
    "json_field": JsonFieldParams,
    "regex": RegexParams,
    "weighted": WeightedParams,
}
"""Checkers whose params are typed here (validated at registration)."""


def parse_params(checker: str, params: dict[str, Any]) -> _Params | None:
    """The typed params of `checker`, or None for a checker typed elsewhere. Raises
    ValueError naming the offending param."""
    model = PARTIAL_PARAMS.get(checker)
    if model is None:
        return None
    try:
        return model.model_validate(params)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            where = ".".join(str(p) for p in e["loc"])
            lines.append(f"params.{where}: {e['msg']}" if where else f"params: {e['msg']}")
        raise ValueError(f"checker {checker!r}: " + "; ".join(lines)) from None
