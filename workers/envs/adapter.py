"""An environment as the RL engine's `Task` (workers.rl.tasks.base): train/eval Examples and a
RewardFn returning totals and named components.

The RL engine's rollout is single-turn: each Example's prompt is the environment's opening
messages rendered to text, and its completion is scored as the final answer. Multi-turn and
tool-use episodes go through `workers.envs.rollout`. Quarantined task ids (from a QC report) are
left out of both splits.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from workers.envs.base import Environment, EnvTask, Message
from workers.rl.tasks.base import Example


def render_plain(messages: Sequence[Message]) -> str:
    """A lone user message is its content; otherwise contents joined by blank lines."""
    return "\n\n".join(m["content"] for m in messages)


class EnvironmentTask:
    """Satisfies workers.rl.tasks.base.Task."""

    def __init__(
        self, env: Environment, *, quarantined: Collection[str] = (),
        render: Callable[[Sequence[Message]], str] = render_plain,
    ) -> None:
        self.env = env
        self.render = render
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

    def score(
        self, examples: Sequence[Example], completions: Sequence[str]
    ) -> tuple[list[float], dict[str, list[float]]]:
        tasks = [self.env.task(ex.meta["task_id"]) for ex in examples]
        scores = self.env.score(tasks, completions)
        names = [c.name for c in self.env.rubric.components]
        return ([s.total for s in scores],
                {n: [s.components.get(n, 0.0) for s in scores] for n in names})

    def corpus(self) -> list[str]:
        return [ex.prompt + ex.reference for ex in self.train + self.eval] + ["\n"]


def as_rl_task(env: Environment, *, quarantined: Collection[str] = ()) -> EnvironmentTask:
    return EnvironmentTask(env, quarantined=quarantined)
