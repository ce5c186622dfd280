"""A terminal task: initial workspace, instruction, budgets, visible and hidden tests.

A task record (inline, or one record of a dataset version) is validated here; its workspace is
given as files (path -> text) and/or a tar archive (base64, e.g. a dataset record's payload).
The archive is read in memory, never extracted on the host: only regular files and
directories are taken, every path goes through the same hostile-path rules as a session write
(`wspath.components`), and links, devices or FIFOs refuse the task with the member named.
"""

from __future__ import annotations

import base64
import binascii
import io
import tarfile
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from workers.sandbox.spec import SessionLimits
from workers.sandbox.wspath import PathRefused, components

MAX_WORKSPACE_BYTES = 64 << 20
MAX_TEST_BYTES = 1 << 20


class TerminalTaskError(ValueError):
    """A task record that cannot be used, with the reason."""


def _test_files(value: dict[str, str]) -> dict[str, str]:
    for name, source in value.items():
        if not name.endswith(".py") or "/" in name or name.startswith("."):
            raise ValueError(f"test file {name!r}: a plain file name ending in .py")
        if len(source.encode()) > MAX_TEST_BYTES:
            raise ValueError(f"test file {name!r} is larger than {MAX_TEST_BYTES} bytes")
        try:
            compile(source, name, "exec")
        except SyntaxError as exc:
            raise ValueError(f"test file {name!r} does not parse: {exc.msg} "
                             f"(line {exc.lineno})") from None
    return value


class ReferenceCall(BaseModel):
    """One tool call of a reference solution, as the policy would make it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Literal["shell", "read_file", "write_file", "edit_file", "run_tests"]
    arguments: dict[str, Any] = Field(default_factory=dict)


class TerminalTask(BaseModel):
    """One task. `hidden_tests` never enter the policy's session: the grader hands them to its
    runner on stdin in a fork of the final workspace. `visible_tests` are what the `run_tests`
    tool runs. `reference` is a shell script that solves the task (QC's first check);
    `reference_calls`, when given, solve it as tool calls, one a turn: what an SFT warm start
    imitates (else one `shell` call of `reference`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=200)
    instruction: str = Field(min_length=1, max_length=100_000)
    files: dict[str, str] = Field(default_factory=dict, description="path -> text")
    archive_b64: str | None = Field(None, description="a tar archive (optionally gzip), base64")
    hidden_tests: dict[str, str] = Field(min_length=1, description="file name -> source")
    visible_tests: dict[str, str] = Field(default_factory=dict)
    reference: str | None = Field(None, max_length=1_000_000, description="a solving script")
    reference_calls: tuple[ReferenceCall, ...] = Field(
        (), max_length=100, description="a solving sequence of tool calls, one a turn")
    max_turns: int = Field(20, ge=1, le=500)
    time_budget_s: float = Field(600.0, gt=0, le=86_400, description="wall time for the agent")
    command_timeout_s: float = Field(60.0, gt=0, le=3600, description="cap per shell call")
    test_timeout_s: float = Field(120.0, gt=0, le=3600, description="the hidden tests, in all")
    limits: SessionLimits = Field(default_factory=SessionLimits)
    split: str = Field("train", pattern="^(train|eval)$")
    metadata: dict[str, str] = Field(default_factory=dict)

    @field_validator("hidden_tests", "visible_tests")
    @classmethod
    def _tests(cls, value: dict[str, str]) -> dict[str, str]:
        return _test_files(value)

    @field_validator("files")
    @classmethod
    def _paths(cls, value: dict[str, str]) -> dict[str, str]:
        for path in value:
            try:
                components(path)
            except PathRefused as exc:
                raise ValueError(f"file {path!r}: {exc}") from None
        return value

    @model_validator(mode="after")
    def _budget_fits(self) -> TerminalTask:
        if len(self.reference_calls) > self.max_turns:
            raise ValueError(f"reference_calls has {len(self.reference_calls)} calls, more than "
                             f"max_turns ({self.max_turns}) allows")
        if self.time_budget_s >= self.limits.wall_s:
            raise ValueError(f"time_budget_s ({self.time_budget_s:g}) must be shorter than the "
                             f"session's lifetime limits.wall_s ({self.limits.wall_s})")
        return self

    def workspace(self) -> dict[str, bytes]:
        """Every initial file (archive first, then `files` over it), checked and sized."""
        out: dict[str, bytes] = {}
        if self.archive_b64:
            out.update(read_archive(self.archive_b64, self.id))
        out.update({p: t.encode() for p, t in self.files.items()})
        total = sum(len(b) for b in out.values())
        if total > MAX_WORKSPACE_BYTES:
            raise TerminalTaskError(f"task {self.id}: the workspace is {total} bytes, more than "
                                    f"{MAX_WORKSPACE_BYTES}")
        return out


def read_archive(data_b64: str, task_id: str = "?") -> dict[str, bytes]:
    """Regular files of a tar archive (base64) by workspace path; anything else refuses it."""
    try:
        raw = base64.b64decode(data_b64, validate=True)
    except (binascii.Error, ValueError):
        raise TerminalTaskError(f"task {task_id}: archive_b64 is not base64") from None
    files: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:*") as tar:
            for member in tar:
                name = member.name.removeprefix("./")
                if member.isdir() or name in ("", "."):
                    continue
                if not member.isreg():
                    raise TerminalTaskError(f"task {task_id}: archive member {member.name!r} is "
                                            "not a regular file (links and devices are refused)")
                try:
                    components(name)
                except PathRefused as exc:
                    raise TerminalTaskError(f"task {task_id}: archive member {member.name!r}: "
                                            f"{exc}") from None
                if member.size > MAX_WORKSPACE_BYTES:
                    raise TerminalTaskError(f"task {task_id}: archive member {name!r} is too "
                                            "large")
                extracted = tar.extractfile(member)
                assert extracted is not None  # a regular member always has data
                files[name] = extracted.read()
    except tarfile.TarError as exc:
        raise TerminalTaskError(f"task {task_id}: archive_b64 is not a tar archive: {exc}") \
            from None
    return files


def parse_task(record: dict[str, Any]) -> TerminalTask:
    """A task from a record, or TerminalTaskError naming every bad field."""
    try:
        return TerminalTask.model_validate(record)
    except ValidationError as exc:
        where = record.get("id", "?") if isinstance(record, dict) else "?"
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'task'}: {e['msg']}"
                             for e in exc.errors())
        raise TerminalTaskError(f"task {where}: {problems}") from None
