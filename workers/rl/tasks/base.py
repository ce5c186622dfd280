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
    train: Sequence[Example]
    eval: Sequence[Example]
    reward: RewardFn

    def corpus(self) -> list[str]:
        """Text a tokenizer is trained on."""
        ...
