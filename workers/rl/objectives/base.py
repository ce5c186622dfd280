"""What an objective provides to the engine: prompts with references, and a reward function.

An objective is what a training run trains on; its examples are usually an environment's tasks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from workers.envs.base import Example

__all__ = ["Example", "Objective", "RewardFn"]


class RewardFn(Protocol):
    """Scores completions; returns the total reward and named components (for metrics)."""

    def __call__(
        self, examples: Sequence[Example], completions: Sequence[str]
    ) -> tuple[list[float], dict[str, list[float]]]: ...


class Objective(Protocol):
    """What a training run trains on: train and eval examples, the reward that scores their
    completions, and a tokenizer corpus. Implemented by the arithmetic demo
    (`ArithmeticObjective`), an environment (`workers.envs.adapter.EnvironmentObjective`),
    several pinned environments (`workers.envs.mixed.MixedObjective`) and object-store records
    (`workers.rl.datacache.RecordObjective`)."""

    # Read-only for the engine: objectives hold lists or compute these, and a settable protocol
    # attribute would demand exactly this type, settable, of every implementation.
    @property
    def train(self) -> Sequence[Example]: ...

    @property
    def eval(self) -> Sequence[Example]: ...

    @property
    def reward(self) -> RewardFn: ...

    def corpus(self) -> list[str]:
        """Text a tokenizer is trained on."""
        ...
