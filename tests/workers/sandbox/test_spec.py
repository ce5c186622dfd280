"""Request validation: what the API can reject before anything runs."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from workers.sandbox.spec import ExecutionRequest, ExecutionResult, Limits, Status


def test_aliases_are_normalised() -> None:
    assert ExecutionRequest(language="Py", code="").language == "python"
    assert ExecutionRequest(language="c++", code="").language == "cpp"
    assert ExecutionRequest(language="golang", code="").language == "go"


def test_unknown_language_is_rejected_with_the_known_ones() -> None:
    with pytest.raises(ValidationError, match="known: python"):
        ExecutionRequest(language="cobol", code="")


@pytest.mark.parametrize("name", ["/etc/passwd", "../x", "a/../../b", "", "a//b"])
def test_extra_files_must_be_plain_relative_paths(name: str) -> None:
    with pytest.raises(ValidationError):
        ExecutionRequest(language="python", code="", files={name: "x"})


def test_read_back_names_must_be_plain() -> None:
    with pytest.raises(ValidationError):
        ExecutionRequest(language="python", code="", read_back=["../etc/shadow"])


def test_in_process_tests_need_a_language_with_a_harness() -> None:
    with pytest.raises(ValidationError, match="unit-test code runs only for python, javascript"):
        ExecutionRequest(language="c", code="", tests="x")
    assert ExecutionRequest(language="javascript", code="", tests="x").tests == "x"


def test_traces_are_python_only() -> None:
    with pytest.raises(ValidationError, match="python only"):
        ExecutionRequest(language="c", code="", trace={})
    assert ExecutionRequest(language="python", code="", trace={}).trace is not None


def test_limits_are_bounded() -> None:
    with pytest.raises(ValidationError):
        Limits(memory_mb=10**9)
    with pytest.raises(ValidationError):
        Limits.model_validate({"wall_ms": 1000, "bogus": 1})


def test_passed_needs_a_verdict_when_there_are_tests() -> None:
    assert ExecutionResult(status=Status.OK).passed
    assert not ExecutionResult(status=Status.OK, tests_passed=False).passed
    assert not ExecutionResult(status=Status.RE).passed
