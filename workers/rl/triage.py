"""Triage of rollouts the platform, not the policy, failed: retry, then drop, never train on 0.

A code reward runs in the sandbox, a tool-use episode calls tools there, a terminal task lives in
a session; when the sandbox engine errs, a session is lost or reclaimed, or a tool's
infrastructure times out, the sample's reward (0) says nothing about the completion. Trained
on, it would push the policy away from whatever it wrote, at random. The signal travels typed:
an environment's `Score.infra`, its objective's reserved component column
`workers.envs.base.INFRA` (1.0 = the platform failed this sample), and `Episode.infra` for an
episode a tool or `respond` ended by raising `InfraError`.

Policy (`RunSpec.triage`): a failed grading is re-run up to `retries` times on the same
completion; a void episode is re-played from the start up to `retries` times. A sample still
failing after that voids its whole group (its group-relative advantage would be computed
against a missing sibling): the producer drops the group, draws more prompts within
`curriculum.max_rounds`, and never records the group in the curriculum's pass rates or replay
buffer. Counted per step (summed over ranks): `infra/failed` (samples whose first scoring or
play failed), `infra/retried` (attempts), `infra/recovered`, `infra/dropped_groups`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from workers.envs.base import INFRA
from workers.rl.objectives import Example, RewardFn

INFRA_COUNTS = ("infra/failed", "infra/retried", "infra/recovered", "infra/dropped_groups")


class InfraFailure(RuntimeError):
    """A step could not be filled with groups the platform scored: the sandbox (or session
    host) is failing persistently. The run stops rather than train on a biased remainder."""


@dataclass
class TriageCounts:
    failed: int = 0
    retried: int = 0
    recovered: int = 0
    dropped_groups: int = 0

    def add_to(self, counts: dict[str, float]) -> None:
        for key, value in (("infra/failed", self.failed), ("infra/retried", self.retried),
                           ("infra/recovered", self.recovered),
                           ("infra/dropped_groups", self.dropped_groups)):
            counts[key] = counts.get(key, 0.0) + float(value)


def take_infra(components: dict[str, list[float]], n: int) -> list[bool]:
    """Remove the INFRA column from `components` (in place); per sample, whether the platform
    failed it. Objectives that never fail for infrastructure have no such column."""
    column = components.pop(INFRA, None)
    if column is None:
        return [False] * n
    if len(column) != n:
        raise ValueError(f"the {INFRA!r} column has {len(column)} values for {n} samples")
    return [v > 0.0 for v in column]


@dataclass
class Graded:
    rewards: list[float]
    components: dict[str, list[float]]
    infra: list[bool]  # still failed for infrastructure after the retries


def grade(reward: RewardFn, examples: Sequence[Example], completions: Sequence[str],
          retries: int, counts: TriageCounts) -> Graded:
    """Score completions; re-score those the platform failed, up to `retries` times each. A
    recovered sample takes the retry's reward and components; the rest stay flagged."""
    n = len(examples)
    got, comps = reward(examples, completions)
    rewards = [float(r) for r in got]
    components = {k: [float(x) for x in v] for k, v in comps.items()}
    infra = take_infra(components, n)
    counts.failed += sum(infra)
    for _ in range(retries):
        todo = [i for i, bad in enumerate(infra) if bad]
        if not todo:
            break
        counts.retried += len(todo)
        again, more = reward([examples[i] for i in todo], [completions[i] for i in todo])
        more = {k: list(v) for k, v in more.items()}
        still = take_infra(more, len(todo))
        for k, i in enumerate(todo):
            if still[k]:
                continue
            rewards[i] = float(again[k])
            for name, values in more.items():
                components.setdefault(name, [0.0] * n)[i] = float(values[k])
            infra[i] = False
            counts.recovered += 1
    return Graded(rewards, components, infra)


def void_groups(infra: Sequence[bool], group: int) -> list[bool]:
    """Per group of `group` consecutive samples, whether any of them failed for infrastructure
    (the group is then dropped whole)."""
    return [any(infra[i:i + group]) for i in range(0, len(infra), group)]
