"""The tools a terminal task offers the policy, as OpenAI tool schemas, and their executor.

`ToolExecutor.execute(name, arguments)` maps one call onto the policy's session: `shell` ->
`exec`, `read_file` -> `read`, `write_file` -> `write`, `edit_file` -> read + one exact
replacement + write, `run_tests` -> the task's visible tests with the test runner. Arguments
arrive as a JSON string (what an OpenAI `tool_calls[].function.arguments` holds) or an object;
each tool's are validated by a strict pydantic model, so a bad call gets an error naming the
argument, which goes back to the model as the tool's result (it is feedback, not a crash).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from workers.envs.base import InfraError
from workers.envs.terminal.grader import CLEAN_ENV, platform_closed, run_tests
from workers.envs.terminal.task import TerminalTask
from workers.sandbox.sessions import Session, SessionClosed
from workers.sandbox.spec import SessionExec
from workers.sandbox.wspath import PathRefused

MAX_OUTPUT = 16_000  # characters of a tool result shown to the model
MAX_READ = 1 << 20


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ShellArgs(_Args):
    command: str = Field(min_length=1, max_length=100_000,
                         description="a bash command, run in /work")
    timeout_s: float | None = Field(None, gt=0, le=3600,
                                    description="seconds before it is killed (capped by the task)")


class ReadFileArgs(_Args):
    path: str = Field(min_length=1, description="a path under /work (relative or absolute)")


class WriteFileArgs(_Args):
    path: str = Field(min_length=1, description="a path under /work (relative or absolute)")
    content: str = Field(max_length=MAX_READ, description="the whole new content")


class EditFileArgs(_Args):
    path: str = Field(min_length=1, description="a path under /work (relative or absolute)")
    old: str = Field(min_length=1, description="text that occurs exactly once in the file")
    new: str = Field(description="what replaces it")


class RunTestsArgs(_Args):
    pass


_ARGS: dict[str, type[_Args]] = {"shell": ShellArgs, "read_file": ReadFileArgs,
                                 "write_file": WriteFileArgs, "edit_file": EditFileArgs,
                                 "run_tests": RunTestsArgs}
_DESCRIPTIONS = {
    "shell": "Run a bash command in the workspace (/work); returns exit status, stdout and "
             "stderr. No network.",
    "read_file": "Read a text file of the workspace.",
    "write_file": "Create or overwrite a file of the workspace with the given content.",
    "edit_file": "Replace one exact occurrence of `old` with `new` in a file of the workspace.",
    "run_tests": "Run the task's visible tests against the workspace; returns each test's "
                 "outcome.",
}


def _schema(name: str) -> dict[str, Any]:
    params = _ARGS[name].model_json_schema()
    params.pop("title", None)
    for prop in params.get("properties", {}).values():
        prop.pop("title", None)
    params.setdefault("properties", {})
    params["additionalProperties"] = False
    return {"type": "function",
            "function": {"name": name, "description": _DESCRIPTIONS[name], "parameters": params}}


TOOL_SCHEMAS: list[dict[str, Any]] = [_schema(n) for n in _ARGS]
"""OpenAI `tools` entries: pass them as `tools=` to a chat completion."""


@dataclass
class ToolResult:
    content: str
    error: bool = False


def _clip(text: str) -> str:
    if len(text) <= MAX_OUTPUT:
        return text
    half = MAX_OUTPUT // 2
    return f"{text[:half]}\n[... {len(text) - MAX_OUTPUT} characters cut ...]\n{text[-half:]}"


def parse_arguments(name: str, arguments: str | Mapping[str, Any] | None) -> _Args | str:
    """The validated arguments of a call, or an error message for the model."""
    model = _ARGS.get(name)
    if model is None:
        return f"error: unknown tool {name!r}; available: {', '.join(_ARGS)}"
    if arguments is None or arguments == "":
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return f"error: {name}: arguments are not valid JSON ({exc.msg} at {exc.pos})"
    if not isinstance(arguments, Mapping):
        return f"error: {name}: arguments must be a JSON object, got {type(arguments).__name__}"
    try:
        return model.model_validate(dict(arguments))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'arguments'}: {e['msg']}"
            for e in exc.errors())
        return f"error: {name}: {problems}"


class ToolExecutor:
    """Runs the policy's tool calls in its session, within the task's budgets."""

    def __init__(self, session: Session, task: TerminalTask) -> None:
        self.session = session
        self.task = task
        self.deadline = time.monotonic() + task.time_budget_s

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def execute(self, name: str, arguments: str | Mapping[str, Any] | None) -> ToolResult:
        args = parse_arguments(name, arguments)
        if isinstance(args, str):
            return ToolResult(args, error=True)
        if self.time_left() <= 0:
            return ToolResult(f"error: the task's time budget ({self.task.time_budget_s:g} s) "
                              "is spent", error=True)
        try:
            return self._run(args)
        except PathRefused as exc:
            return ToolResult(f"error: {name}: {exc}", error=True)
        except FileNotFoundError:
            return ToolResult(f"error: {name}: no such file: {getattr(args, 'path', '')}",
                              error=True)
        except IsADirectoryError:
            return ToolResult(f"error: {name}: is a directory: {getattr(args, 'path', '')}",
                              error=True)
        except SessionClosed as exc:
            if platform_closed(exc.reason):  # not the policy's doing: the episode is void
                raise InfraError(f"the episode's session closed under it: {exc.reason}") \
                    from exc
            return ToolResult(f"error: the workspace is gone ({exc.reason})", error=True)

    def _run(self, args: _Args) -> ToolResult:
        if isinstance(args, ShellArgs):
            cap = min(self.task.command_timeout_s, max(self.time_left(), 0.1))
            timeout = min(args.timeout_s or cap, cap)
            r = self.session.exec(SessionExec(cmd=args.command, timeout_s=timeout,
                                              env=dict(CLEAN_ENV), output_bytes=256 << 10))
            head = f"status: {r.status.value}"
            if r.exit_code is not None:
                head += f" (exit code {r.exit_code})"
            if r.signal:
                head += f" (signal {r.signal})"
            if r.message:
                head += f"\n{r.message}"
            body = f"{head}\nstdout:\n{r.stdout.decode(errors='replace')}"
            if r.stderr:
                body += f"\nstderr:\n{r.stderr.decode(errors='replace')}"
            return ToolResult(_clip(body), error=r.status.value != "OK")
        if isinstance(args, ReadFileArgs):
            data = self.session.read(args.path, limit=MAX_READ)
            return ToolResult(_clip(data.decode(errors="replace")))
        if isinstance(args, WriteFileArgs):
            data = args.content.encode()
            self.session.write(args.path, data)
            return ToolResult(f"wrote {len(data)} bytes to {args.path}")
        if isinstance(args, EditFileArgs):
            text = self.session.read(args.path, limit=MAX_READ).decode(errors="replace")
            count = text.count(args.old)
            if count != 1:
                return ToolResult(f"error: edit_file: `old` occurs {count} times in "
                                  f"{args.path}; it must occur exactly once", error=True)
            self.session.write(args.path, text.replace(args.old, args.new).encode())
            return ToolResult(f"edited {args.path}")
        assert isinstance(args, RunTestsArgs)
        if not self.task.visible_tests:
            return ToolResult("this task has no visible tests", error=True)
        timeout = min(self.task.test_timeout_s, max(self.time_left(), 0.1))
        grade = run_tests(self.session, dict(self.task.visible_tests), timeout)
        if grade.infra:
            raise InfraError(f"run_tests: {grade.error}")
        if grade.error:
            return ToolResult(f"error: {grade.error}", error=True)
        lines = [f"{grade.passed}/{grade.total} passed"]
        for test in grade.results:
            lines.append(f"{str(test.get('outcome', '?')).upper()} {test.get('test')}")
            if test.get("message"):
                lines.append(str(test["message"]).rstrip())
        if grade.output.strip():
            lines.append(f"output:\n{grade.output}")
        return ToolResult(_clip("\n".join(lines)), error=grade.passed != grade.total)
