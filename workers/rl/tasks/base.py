"""What a task provides to the engine: prompts with references, and a reward function."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from workers.envs.base import Example

__all__ = ["Example", "RewardFn", "Task"]


class RewardFn(Protocol):
    """Scores completions; returns the total reward and named components (for metrics)."""

    def __call__(
        self, examples: Sequence[Example], completions: Sequence[str]
    ) -> tuple[list[float], dict[str, list[float]]]: ...


class Task(Protocol):
    # Read-only for the engine: tasks hold lists or compute these, and a settable protocol
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
