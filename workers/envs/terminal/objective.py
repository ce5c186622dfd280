"""Terminal tasks as what the RL engine trains on (`workers.rl.objectives.base.Objective`).

Each task's `split` puts it in `train` or `eval`; an Example's prompt is the episode's opening
in the engine's plain layout (system prompt with the tools offered, then the instruction) and
its `reference` is the first reference call as the policy writes it. The engine plays every
example as a tool-use episode (`episode_env` -> `TerminalPlay`, played by
`workers.envs.terminal.play.play_terminal` in a session forked from the task's prepared
workspace) and the reward is the hidden tests' grade of the final workspace: no reward function
reads the policy's text (`score` refuses to).

The objective owns a `SessionManager`, opened on first use: one snapshot per task, prepared
once and shared by every episode of it (a GRPO group forks one workspace). `close()` closes the
sessions and drops the snapshots; the trainer calls it when the run ends.

`warm_start_example` gives SFT the whole reference episode (`Example.turns`): the reference
calls played for real in a session, their true tool results as environment pieces, so SFT
learns exactly the layout RL samples in.
"""

from __future__ import annotations

import string
import threading
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from workers.envs.adapter import SEPARATOR, message_text, render_opening
from workers.envs.base import Example
from workers.envs.rollout import ChatCodec, Episode, GenerateMany
from workers.envs.terminal.play import (
    DONE_TEXT,
    opening,
    play_terminal_group,
    reference_calls,
    reference_turns,
)
from workers.envs.terminal.task import TerminalTask
from workers.envs.toolcalls import call_text

EPISODE_MAX_TOKENS = 4096
GROUP_THREADS = 8


@dataclass(frozen=True)
class TerminalPlay:
    """What `episode_env` hands the RL engine for one terminal example: `play` runs a group
    of its episodes and returns them graded (`Episode.score`; void ones carry `infra`)."""

    objective: TerminalObjective
    task: TerminalTask

    @property
    def max_turns(self) -> int:
        return self.task.max_turns

    def play(self, generate_many: GenerateMany, codec: ChatCodec, max_tokens: int,
             count: int = 1) -> list[Episode]:
        """`count` episodes (a group) played in lockstep, graded."""
        manager, snapshot = self.objective.prepared(self.task)
        return play_terminal_group(manager, self.task, snapshot, count, generate_many, codec,
                                   max_tokens, self.objective.pool)


class TerminalObjective:
    """Terminal tasks as an objective (see the module docstring)."""

    interaction = "tool_use"

    def __init__(self, tasks: Sequence[TerminalTask], *, name: str = "terminal",
                 quarantined: Collection[str] = (),
                 episode_max_tokens: int = EPISODE_MAX_TOKENS) -> None:
        excluded = set(quarantined)
        kept = [t for t in tasks if t.id not in excluded]
        self.environment = name
        self.episode_max_tokens = episode_max_tokens
        self.tasks = {t.id: t for t in kept}
        if len(self.tasks) != len(kept):
            raise ValueError("terminal task ids must be unique")
        self.train: list[Example] = [self.example(t) for t in kept if t.split == "train"]
        self.eval: list[Example] = [self.example(t) for t in kept if t.split == "eval"]
        if not self.train and not self.eval:
            raise ValueError("no terminal tasks left to train or evaluate on")
        self.reward = self.score
        self._manager: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._snapshots: dict[str, str] = {}
        self._turns: dict[str, tuple[tuple[str, bool], ...]] = {}
        self._lock = threading.Lock()

    def example(self, task: TerminalTask) -> Example:
        first = reference_calls(task)[0] if (task.reference or task.reference_calls) else None
        return Example(prompt=render_opening(opening(task)),
                       reference=call_text(first["name"], first["arguments"]) if first else "",
                       meta={"task_id": task.id})

    def episode_env(self, example: Example) -> TerminalPlay:
        return TerminalPlay(self, self.tasks[example.meta["task_id"]])

    def score(self, examples: Sequence[Example], completions: Sequence[str]
              ) -> tuple[list[float], dict[str, list[float]]]:
        raise TypeError("a terminal task is graded by its hidden tests on the final workspace "
                        "of an episode (TerminalPlay.play), never from a completion's text")

    def corpus(self) -> list[str]:
        """The prompts and every reference call as the policy writes it, and every printable
        character: tool results are text only the sandbox writes."""
        calls = [call_text(c["name"], c["arguments"]) for t in self.tasks.values()
                 if t.reference or t.reference_calls for c in reference_calls(t)]
        return [ex.prompt for ex in self.train + self.eval] + calls + \
            [DONE_TEXT, SEPARATOR, string.printable]

    # sessions ------------------------------------------------------------------------------

    def prepared(self, task: TerminalTask) -> tuple[Any, str]:
        """The session manager and the task's prepared snapshot (made on first use)."""
        with self._lock:
            if self._manager is None:
                from workers.envs.terminal.grader import GRADER_LIMITS
                from workers.sandbox.sessions import SessionManager

                self._manager = SessionManager()
                # Episodes and gradings fork into sandboxes started ahead, in the background
                kinds = {t.limits.model_dump_json(): t.limits for t in self.tasks.values()}
                for limits in [*kinds.values(), GRADER_LIMITS]:
                    self._manager.keep_warm(limits, GROUP_THREADS)
            if task.id not in self._snapshots:
                from workers.envs.terminal.episode import prepare

                self._snapshots[task.id] = prepare(self._manager, task)
            return self._manager, self._snapshots[task.id]

    @property
    def pool(self) -> ThreadPoolExecutor:
        """Threads that wait on a group's sessions side by side (forks, tools, gradings)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=GROUP_THREADS,
                                                thread_name_prefix="terminal")
            return self._pool

    def warm_start_example(self, example: Example) -> Example:
        """`example` with its reference episode as `turns` (played once per task, then kept)."""
        task = self.tasks[example.meta["task_id"]]
        if task.id not in self._turns:
            manager, snapshot = self.prepared(task)
            ref = reference_turns(manager, task, snapshot, SEPARATOR, message_text)
            if ref.reward < 1.0:
                raise ValueError(f"task {task.id}: its reference calls do not pass its hidden "
                                 "tests, so there is nothing right to imitate; fix the task or "
                                 "quarantine it with a QC run")
            self._turns[task.id] = tuple((message_text(m), False) for m in opening(task)) + \
                ref.pieces
        return replace(example, turns=self._turns[task.id])

    def close(self) -> None:
        with self._lock:
            manager, self._manager = self._manager, None
            pool, self._pool = self._pool, None
            self._snapshots.clear()
        if pool is not None:
            pool.shutdown(wait=True)
        if manager is not None:
            manager.close()
