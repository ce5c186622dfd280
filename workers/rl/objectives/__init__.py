"""Objectives: what a run trains on (prompts with references, a reward function, a corpus)."""

from workers.envs.builtins.arithmetic import ArithmeticObjective, build_objective, exact_match
from workers.rl.objectives.base import Example, Objective, RewardFn

__all__ = ["ArithmeticObjective", "Example", "Objective", "RewardFn", "build_objective",
           "exact_match"]
