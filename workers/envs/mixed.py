"""Several pinned environments trained as one objective (a run that pins more than one)."""

from __future__ import annotations

import dataclasses
from typing import Any

from workers.envs.base import INFRA


class MixedObjective:
    """Several environments' objectives as one: their examples side by side, each completion
    scored by the environment it came from. Reward components are named
    ``<environment>/<component>`` and are 0 for the other environments' examples."""

    def __init__(self, objectives: list[Any], names: list[str]) -> None:
        self.objectives, self.names = objectives, names
        self.train = [self._tag(e, i) for i, o in enumerate(objectives) for e in o.train]
        self.eval = [self._tag(e, i) for i, o in enumerate(objectives) for e in o.eval]
        self.components = [f"{names[i]}/{c.name}" for i, o in enumerate(objectives)
                           for c in o.env.rubric.components]
        self.reward = self.score
        # Multi-turn / tool-use environments are played as episodes (workers.rl.episodes);
        # single-turn ones answer episode_env with None and keep the one-shot path.
        self.interaction = next((o.interaction for o in objectives
                                 if getattr(o, "interaction", "single_turn") != "single_turn"),
                                "single_turn")
        self.episode_max_tokens = max(getattr(o, "episode_max_tokens", 4096) for o in objectives)

    def episode_env(self, example: Any) -> Any:
        objective = self.objectives[int(example.meta["env"])]
        play = getattr(objective, "episode_env", None)
        return play(self._untag(example)) if play is not None else None

    @staticmethod
    def _tag(example: Any, index: int) -> Any:
        meta = {**example.meta, "env": str(index),
                "task_id": f"{index}:{example.meta.get('task_id', '')}"}
        return dataclasses.replace(example, meta=meta)

    @staticmethod
    def _untag(example: Any) -> Any:
        meta = {k: v for k, v in example.meta.items() if k != "env"}
        meta["task_id"] = example.meta["task_id"].split(":", 1)[1]
        return dataclasses.replace(example, meta=meta)

    def score(self, examples: list[Any], completions: list[str]
              ) -> tuple[list[float], dict[str, list[float]]]:
        totals = [0.0] * len(examples)
        parts = {name: [0.0] * len(examples) for name in self.components}
        for i, objective in enumerate(self.objectives):
            rows = [j for j, e in enumerate(examples) if e.meta["env"] == str(i)]
            if not rows:
                continue
            got, comps = objective.reward([self._untag(examples[j]) for j in rows],
                                     [completions[j] for j in rows])
            for k, j in enumerate(rows):
                totals[j] = got[k]
                for name, values in comps.items():
                    # the infra column is the engine's signal, not a component: never prefixed
                    column = name if name == INFRA else f"{self.names[i]}/{name}"
                    parts.setdefault(column, [0.0] * len(examples))[j] = values[k]
        return totals, parts

    def corpus(self) -> list[str]:
        return [line for o in self.objectives for line in o.corpus()]
