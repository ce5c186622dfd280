"""An environment as the RL engine's `Objective` (workers.rl.objectives.base): train/eval
Examples and a RewardFn returning totals and named components.

A single-turn environment's Example prompt is its opening messages rendered to text and its
completion is scored as the final answer. A multi-turn or tool-use environment says so through
`interaction` and `episode_env(example)`: the RL engine (`workers.rl.episodes`) then plays each
example as an episode (`workers.envs.rollout`), in the plain layout `message_text` defines, and
scores the last assistant turn with `reward`; its Example prompt is the episode's opening text,
so SFT on references sees the same context as the first turn. Quarantined task ids (from a QC
report) are left out of both splits. No Django or torch here.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Collection, Sequence

from workers.envs.base import INFRA, Environment, EnvTask, Example, Message, Mode, Score
from workers.sandbox.spec import VERDICTS

SEPARATOR = "\n\n"
EPISODE_MAX_TOKENS = 4096


def render_plain(messages: Sequence[Message]) -> str:
    """A lone user message is its content; otherwise contents joined by blank lines."""
    return SEPARATOR.join(m["content"] for m in messages)


def message_text(message: Message) -> str:
    """One non-assistant message in an RL episode: its content and a blank line; a tool result
    is tagged with the tool's name."""
    if message["role"] == "tool":
        return f"[{message.get('name', 'tool')} result]\n{message['content']}{SEPARATOR}"
    return message["content"] + SEPARATOR


def render_opening(messages: Sequence[Message]) -> str:
    """The text an RL episode starts from (its first turn's whole context)."""
    return "".join(message_text(m) for m in messages)


class EnvironmentObjective:
    """Satisfies workers.rl.objectives.base.Objective. `interaction` (the environment's mode),
    `environment` (its name), `episode_env` and `episode_max_tokens` (the token budget of one
    episode, prompt included) are what the RL engine reads to play multi-turn episodes."""

    def __init__(
        self, env: Environment, *, quarantined: Collection[str] = (),
        render: Callable[[Sequence[Message]], str] | None = None,
        episode_max_tokens: int = EPISODE_MAX_TOKENS,
    ) -> None:
        self.env = env
        self.interaction: Mode = env.mode
        self.environment = env.name
        self.episode_max_tokens = episode_max_tokens
        self.render = render or (render_plain if env.mode == "single_turn" else render_opening)
        excluded = set(quarantined)
        self.train: list[Example] = [self.example(t) for t in env.split("train")
                                     if t.id not in excluded]
        self.eval: list[Example] = [self.example(t) for t in env.split("eval")
                                    if t.id not in excluded]
        self.reward = self.score

    def example(self, task: EnvTask) -> Example:
        meta = {"task_id": task.id}
        if task.difficulty:
            meta["difficulty"] = task.difficulty
        if task.topic:
            meta["topic"] = task.topic
        return Example(prompt=self.render(self.env.initial_messages(task)),
                       reference=task.reference or task.answer or "", meta=meta)

    def episode_env(self, example: Example) -> tuple[Environment, EnvTask] | None:
        """The environment and task an example plays as an episode; None when single-turn."""
        if self.interaction == "single_turn":
            return None
        return self.env, self.env.task(example.meta["task_id"])

    def score(
        self, examples: Sequence[Example], completions: Sequence[str]
    ) -> tuple[list[float], dict[str, list[float]]]:
        tasks = [self.env.task(ex.meta["task_id"]) for ex in examples]
        scores = self.env.score(tasks, completions)
        names = [c.name for c in self.env.rubric.components]
        columns = {n: [s.components.get(n, 0.0) for s in scores] for n in names}
        columns.update(verdict_columns(scores))
        if any(s.infra for s in scores):  # the engine retries or drops these (INFRA)
            columns[INFRA] = [1.0 if s.infra else 0.0 for s in scores]
        return [s.total for s in scores], columns

    def corpus(self) -> list[str]:
        """Text a trained tokenizer learns from. Episodes also hold text only the environment
        writes (test output, tool results): every printable character gets a token."""
        text = [ex.prompt + ex.reference for ex in self.train + self.eval] + ["\n"]
        return text if self.interaction == "single_turn" else [*text, string.printable]


def verdict_columns(scores: Sequence[Score]) -> dict[str, list[float]]:
    """How each code verdict was reached, as 0/1 columns `verdict_<kind>` (the run reports
    their means as `reward/verdict_<kind>`: the share of a step's rollouts whose tests ran and
    passed, failed, whose candidate exited early, timed out, or whose grader failed), so a
    reward that climbs for any reason but passing tests shows. Empty for non-code rubrics."""
    kinds = [s.info.get("verdict") for s in scores]
    if not any(kinds):
        return {}
    return {f"verdict_{v}": [float(k == v) for k in kinds] for v in VERDICTS}


def as_objective(env: Environment, *, quarantined: Collection[str] = ()) -> EnvironmentObjective:
    """The environment as what the RL engine trains on, its quarantined task ids left out."""
    return EnvironmentObjective(env, quarantined=quarantined)
