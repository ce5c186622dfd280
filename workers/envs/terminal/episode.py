"""One terminal-task episode: a session forked from the task's prepared workspace, the
policy's tool calls run in it, the hidden tests graded in a fork of its final state.

Messages are OpenAI chat messages: the assistant's carry `tool_calls`
(`[{"id", "type": "function", "function": {"name", "arguments": "<json>"}}]`) and each call is
answered by a `{"role": "tool", "tool_call_id", "content"}` message. A turn without a tool call
ends the episode, as do the turn budget and the time budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from workers.envs.terminal.grader import CLEAN_ENV, GradeResult, grade_session
from workers.envs.terminal.task import TerminalTask
from workers.envs.terminal.tools import TOOL_SCHEMAS, ToolExecutor
from workers.sandbox.sessions import Session, SessionManager
from workers.sandbox.spec import SessionExec

SYSTEM_PROMPT = ("You are working in a Linux shell sandbox; the workspace is /work (the current "
                 "directory). Use the tools to inspect and change it until the task is done, "
                 "then answer without a tool call.")

Policy = Callable[[Sequence[dict[str, Any]], Sequence[dict[str, Any]]], dict[str, Any]]
"""policy(messages, tools) -> the assistant message (content, optional tool_calls)."""


def prepare(manager: SessionManager, task: TerminalTask) -> str:
    """A snapshot of the task's initial workspace, to fork every episode of it from (a GRPO
    group shares one). The preparing session is closed; drop the snapshot when done."""
    session = manager.create(task.limits, files=task.workspace())
    try:
        return session.snapshot()
    finally:
        session.close("prepared")


@dataclass
class TerminalEpisode:
    task: TerminalTask
    session: Session
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0
    stop_reason: str | None = None
    executor: ToolExecutor = field(init=False)

    @classmethod
    def start(cls, manager: SessionManager, task: TerminalTask,
              snapshot_id: str | None = None) -> TerminalEpisode:
        if snapshot_id is None:
            session = manager.create(task.limits, files=task.workspace())
        else:
            session = manager.fork(snapshot_id, task.limits)
        episode = cls(task, session)
        episode.executor = ToolExecutor(session, task)
        episode.messages = [{"role": "system", "content": SYSTEM_PROMPT},
                            {"role": "user", "content": task.instruction}]
        return episode

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def step(self, assistant: dict[str, Any]) -> list[dict[str, Any]]:
        """Record the policy's turn, run its tool calls, return the tool messages."""
        if self.done:
            raise RuntimeError(f"the episode is over ({self.stop_reason})")
        calls = assistant.get("tool_calls") or []
        self.messages.append({"role": "assistant", "content": assistant.get("content") or "",
                              **({"tool_calls": calls} if calls else {})})
        self.turns += 1
        if not calls:
            self.stop_reason = "done"
            return []
        replies = []
        for i, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                content = 'error: a tool call is {"function": {"name": ..., "arguments": ...}}'
            else:
                content = self.executor.execute(fn["name"], fn.get("arguments")).content
            call_id = call.get("id") if isinstance(call, dict) else None
            replies.append({"role": "tool", "tool_call_id": str(call_id or f"call_{i}"),
                            "content": content})
        self.messages.extend(replies)
        if self.turns >= self.task.max_turns:
            self.stop_reason = "max_turns"
        elif self.executor.time_left() <= 0:
            self.stop_reason = "time_budget"
        return replies

    def grade(self) -> GradeResult:
        """The hidden tests on the final workspace (the session is closed by it)."""
        if self.stop_reason is None:
            self.stop_reason = "stopped"
        return grade_session(self.session, dict(self.task.hidden_tests),
                             self.task.test_timeout_s)

    def close(self) -> None:
        self.session.close("episode over")


@dataclass
class EpisodeResult:
    messages: list[dict[str, Any]]
    turns: int
    stop_reason: str
    grade: GradeResult
    seconds: float


def run_episode(manager: SessionManager, task: TerminalTask, policy: Policy,
                snapshot_id: str | None = None) -> EpisodeResult:
    """Play one episode with `policy` and grade it."""
    started = time.monotonic()
    episode = TerminalEpisode.start(manager, task, snapshot_id)
    try:
        while not episode.done:
            episode.step(policy(list(episode.messages), TOOL_SCHEMAS))
        grade = episode.grade()
    finally:
        if episode.session.closed_reason is None:
            episode.close()
    return EpisodeResult(episode.messages, episode.turns, episode.stop_reason or "done", grade,
                         time.monotonic() - started)


def run_script(manager: SessionManager, task: TerminalTask, script: str | None,
               snapshot_id: str | None = None) -> GradeResult:
    """Run a shell script (the reference solution; None: nothing) in a fresh episode session
    and grade the result: what QC plays instead of a policy."""
    episode = TerminalEpisode.start(manager, task, snapshot_id)
    try:
        if script:
            episode.session.write(".crucible-solution.sh", script.encode(), mode=0o755)
            episode.session.exec(SessionExec(
                cmd="bash .crucible-solution.sh; rm -f .crucible-solution.sh",
                timeout_s=min(task.time_budget_s, 3600), env=dict(CLEAN_ENV)))
        return episode.grade()
    finally:
        if episode.session.closed_reason is None:
            episode.close()
