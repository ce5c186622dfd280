"""Terminal episodes at the token level: what the RL engine plays for a terminal task.

`workers.envs.terminal.episode` plays a task with a policy that answers OpenAI messages; the
trainer needs more: the exact ids it sampled, their logprobs and which tokens were the
environment's. `play_terminal` is that loop over the same `TerminalEpisode`: each turn is
sampled from the episode's own ids (`workers.envs.rollout.sample_turn`, never re-encoded), its
tool calls are parsed from the text in the Hermes / Qwen format the opening offers the tools in
(`workers.envs.toolcalls`), run in the episode's session, and their results are encoded and
appended with loss mask 0. The score is the hidden tests' grade of the final workspace, never the
policy's text. A platform failure (a fork that could not be made, a lost session, a grading that
could not run) makes the episode void (`infra`), for the engine to re-play or drop.

`reference_turns` turns a task's reference tool calls into the same layout, played for real in a
session, so SFT imitates exactly what RL later samples and scores.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from workers.envs.base import InfraError, Message, Score
from workers.envs.rollout import (
    ChatCodec,
    Episode,
    Generate,
    GenerateMany,
    end_turn,
    open_episode,
)
from workers.envs.terminal.episode import SYSTEM_PROMPT, TerminalEpisode
from workers.envs.terminal.task import TerminalTask
from workers.envs.terminal.tools import TOOL_SCHEMAS
from workers.envs.toolcalls import call_text, parse_completion, tools_prompt
from workers.sandbox.sessions import SessionError, SessionManager

DONE_TEXT = "Done."
"""The last assistant turn of a reference transcript: an answer without a tool call ends it."""


def opening(task: TerminalTask) -> list[Message]:
    """The messages a terminal episode starts from: the system prompt with the tools offered in
    the Hermes format, then the instruction."""
    return [{"role": "system", "content": f"{SYSTEM_PROMPT}\n\n{tools_prompt(TOOL_SCHEMAS)}"},
            {"role": "user", "content": task.instruction}]


def _tool_messages(episode: TerminalEpisode, replies: Sequence[dict[str, Any]]
                   ) -> list[Message]:
    """The tool replies with the name of the tool each answers (the layout tags results)."""
    names = {c["id"]: c["function"]["name"]
             for m in episode.messages if m["role"] == "assistant"
             for c in m.get("tool_calls") or []}
    return [{"role": "tool", "name": names.get(r["tool_call_id"], "tool"),
             "content": r["content"]} for r in replies]


def _void(ep: Episode, reason: str) -> Episode:
    ep.stop_reason, ep.infra = "infra", reason
    ep.score = Score(0.0, {}, infra=reason)
    return ep


def play_terminal(manager: SessionManager, task: TerminalTask, snapshot_id: str | None,
                  generate: Generate, codec: ChatCodec, max_tokens: int) -> Episode:
    """Play `task` once (see `play_terminal_group`)."""
    return play_terminal_group(manager, task, snapshot_id, 1,
                               lambda contexts: [generate(c) for c in contexts], codec,
                               max_tokens)[0]


def play_terminal_group(
    manager: SessionManager, task: TerminalTask, snapshot_id: str | None, count: int,
    generate_many: GenerateMany, codec: ChatCodec, max_tokens: int,
    pool: Executor | None = None,
) -> list[Episode]:
    """Play `count` episodes of `task` in lockstep and grade them (see the module docstring):
    each turn of the episodes still running is sampled in one batch, their tool calls run
    side by side on `pool` (sessions are processes: the threads wait, they do not compute),
    and so do the forks at the start and the gradings at the end. `stop_reason` is the rollout
    driver's: `done` (the policy answered without a call, or the task's turn or time budget
    ended it), `max_tokens`, or `infra`."""
    each: Callable[..., Iterator[Any]] = pool.map if pool is not None else map
    eps = [open_episode(task.id, opening(task), codec) for _ in range(count)]

    def start(_: int) -> TerminalEpisode | Exception:
        try:
            return TerminalEpisode.start(manager, task, snapshot_id)
        except (SessionError, OSError) as exc:
            return exc

    episodes: dict[int, TerminalEpisode] = {}
    for i, got in enumerate(each(start, range(count))):
        if isinstance(got, Exception):
            _void(eps[i], f"could not start the episode's session: {got}")
        else:
            episodes[i] = got
    try:
        active = sorted(episodes)
        while active:
            for i in active:
                eps[i].extend(codec.assistant_prefix(), sampled=False)
            sampled = generate_many([eps[i].token_ids for i in active])
            texts = {i: end_turn(eps[i], ids, lps, codec)
                     for i, (ids, lps) in zip(active, sampled, strict=True)}
            for i in active:
                eps[i].messages.append({"role": "assistant", "content": texts[i]})
                if len(eps[i].token_ids) >= max_tokens:
                    eps[i].stop_reason = "max_tokens"
            stepping = [i for i in active if eps[i].stop_reason != "max_tokens"]
            active = []
            for i, replies in zip(stepping, each(_step, [episodes[i] for i in stepping],
                                                 [texts[i] for i in stepping]), strict=True):
                if isinstance(replies, InfraError):
                    _void(eps[i], str(replies) or type(replies).__name__)
                elif not episodes[i].done and _append_results(eps[i], episodes[i], replies,
                                                              codec, max_tokens):
                    active.append(i)
        graded = [i for i in sorted(episodes) if eps[i].infra is None]
        for i, grade in zip(graded, each(lambda i: episodes[i].grade(), graded), strict=True):
            score = eps[i].score = grade.as_score()
            if grade.infra:
                eps[i].stop_reason, eps[i].infra = "infra", score.infra
    finally:
        for episode in episodes.values():
            if episode.session.closed_reason is None:
                episode.close()
    return eps


def _step(episode: TerminalEpisode, text: str) -> list[dict[str, Any]] | InfraError:
    """Run the calls a sampled turn makes; a platform failure is returned, not raised."""
    content, calls = parse_completion(text)
    assistant: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if calls:
        assistant["tool_calls"] = [c.as_openai() for c in calls]
    try:
        return episode.step(assistant)
    except InfraError as exc:
        return exc


def _append_results(ep: Episode, episode: TerminalEpisode, replies: list[dict[str, Any]],
                    codec: ChatCodec, max_tokens: int) -> bool:
    """Append the tool results to the episode; False when they would not fit its budget."""
    messages = _tool_messages(episode, replies)
    encoded = [codec.encode_message(m) for m in messages]
    if len(ep.token_ids) + sum(map(len, encoded)) + len(codec.assistant_prefix()) >= max_tokens:
        ep.stop_reason = "max_tokens"
        return False
    for message, ids in zip(messages, encoded, strict=True):
        ep.messages.append(message)
        ep.extend(ids, sampled=False)
    return True


@dataclass(frozen=True)
class ReferenceTurns:
    """A reference episode in the RL layout: `pieces` follow the prompt, each (text, sampled):
    a sampled piece is one assistant turn (the trainer appends the end-of-turn token), the
    others are encoded one by one, as the rollout driver encodes environment messages."""

    pieces: tuple[tuple[str, bool], ...]
    reward: float

    @property
    def first(self) -> str:
        return self.pieces[0][0]

    def text(self) -> str:
        return "".join(text for text, _ in self.pieces)


def reference_calls(task: TerminalTask) -> list[dict[str, Any]]:
    """The task's solving tool calls: `reference_calls`, else one `shell` call of `reference`."""
    if task.reference_calls:
        return [{"name": c.name, "arguments": c.arguments} for c in task.reference_calls]
    if task.reference:
        return [{"name": "shell", "arguments": {"command": task.reference}}]
    raise ValueError(f"task {task.id} has no reference and no reference_calls to imitate")


def reference_turns(manager: SessionManager, task: TerminalTask, snapshot_id: str | None,
                    after_turn: str, render_tool: Callable[[Message], str]) -> ReferenceTurns:
    """Play the task's reference calls in a session (one call a turn) and record the episode
    they make: each call as the policy would write it, each real tool result as the
    environment would answer, then `DONE_TEXT` when turns remain. `render_tool(message)` is the
    layout's text of a tool message; `after_turn` what follows each assistant turn."""
    episode = TerminalEpisode.start(manager, task, snapshot_id)
    pieces: list[tuple[str, bool]] = []
    try:
        for i, call in enumerate(reference_calls(task)):
            if episode.done:
                raise ValueError(f"task {task.id}: its reference has more calls than its "
                                 f"max_turns ({task.max_turns}) allows")
            text = call_text(call["name"], call["arguments"])
            pieces.append((text, True))
            replies = episode.step({"content": "", "tool_calls": [{
                "id": f"ref_{i}", "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]})
            pieces.append((after_turn, False))
            if not episode.done:
                pieces += [(render_tool(m), False) for m in _tool_messages(episode, replies)]
        if not episode.done:
            episode.step({"content": DONE_TEXT})
            pieces += [(DONE_TEXT, True), (after_turn, False)]
        grade = episode.grade()
    finally:
        if episode.session.closed_reason is None:
            episode.close()
    if grade.infra:
        raise InfraError(f"task {task.id}: grading its reference failed: {grade.error}")
    return ReferenceTurns(tuple(pieces[:-1]), grade.reward)  # the trailing scaffold is not kept
