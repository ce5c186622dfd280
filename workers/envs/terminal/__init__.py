"""Terminal tasks: an agent works in a long-lived sandbox session through tools (shell, files,
visible tests); hidden tests graded by a trusted runner in a fork of its final workspace decide
the reward. See docs/agents.md."""

from workers.envs.terminal.episode import TerminalEpisode, run_episode
from workers.envs.terminal.grader import GradeResult, grade_snapshot
from workers.envs.terminal.task import TerminalTask, TerminalTaskError
from workers.envs.terminal.tools import TOOL_SCHEMAS, ToolExecutor, ToolResult

__all__ = ["TOOL_SCHEMAS", "GradeResult", "TerminalEpisode", "TerminalTask", "TerminalTaskError",
           "ToolExecutor", "ToolResult", "grade_snapshot", "run_episode"]
