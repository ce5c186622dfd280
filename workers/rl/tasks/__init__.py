"""Task sources: prompts, references and reward functions."""

from workers.envs.builtins.arithmetic import ArithmeticTask, build_task, exact_match
from workers.rl.tasks.base import Example, RewardFn, Task

__all__ = ["ArithmeticTask", "Example", "RewardFn", "Task", "build_task", "exact_match"]
