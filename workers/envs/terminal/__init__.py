"""Terminal tasks: an agent works in a long-lived sandbox session through tools (shell, files,
visible tests); hidden tests graded by a trusted runner in a fork of its final workspace decide
the reward. See docs/agents.md.

The names below load on first use (PEP 562): `workers.envs.spec` imports `terminal.task`,
which runs this file first, and the episode, grader and tools modules import
`workers.envs.base`, which imports the spec: importing them here made a cycle."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.envs.terminal.episode import TerminalEpisode, run_episode
    from workers.envs.terminal.grader import GradeResult, grade_snapshot
    from workers.envs.terminal.task import TerminalTask, TerminalTaskError
    from workers.envs.terminal.tools import TOOL_SCHEMAS, ToolExecutor, ToolResult

_HOME = {"TerminalEpisode": "episode", "run_episode": "episode", "GradeResult": "grader",
         "grade_snapshot": "grader", "TerminalTask": "task", "TerminalTaskError": "task",
         "TOOL_SCHEMAS": "tools", "ToolExecutor": "tools", "ToolResult": "tools"}

__all__ = ["TOOL_SCHEMAS", "GradeResult", "TerminalEpisode", "TerminalTask", "TerminalTaskError",
           "ToolExecutor", "ToolResult", "grade_snapshot", "run_episode"]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
