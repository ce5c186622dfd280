"""Group-relative advantage estimators. Input rewards are (groups, group_size): the completions
sampled for one prompt form a group, and each is compared only with its siblings."""

from __future__ import annotations

import torch

EPS = 1e-6


def grpo(rewards: torch.Tensor, scale_std: bool = True, eps: float = EPS) -> torch.Tensor:
    """GRPO (Shao et al. 2024): reward minus the group mean, divided by the group's (unbiased)
    std when `scale_std`. A group whose rewards are all equal gets zero advantage."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_std:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def dr_grpo(rewards: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO (Liu et al. 2025): no std scaling (it up-weights too-easy and too-hard prompts).
    Its other half, no per-sequence length normalisation, is `loss_agg = "seq_sum_norm"`."""
    return grpo(rewards, scale_std=False)


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out: each sample's baseline is the mean of the *other* samples,
    which equals G/(G-1) times the centred reward."""
    g = rewards.shape[1]
    others_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (g - 1)
    return rewards - others_mean


def compute(name: str, rewards: torch.Tensor) -> torch.Tensor:
    if name == "grpo":
        return grpo(rewards)
    if name == "grpo_no_std":
        return grpo(rewards, scale_std=False)
    if name == "dr_grpo":
        return dr_grpo(rewards)
    if name == "rloo":
        return rloo(rewards)
    raise ValueError(f"unknown advantage estimator {name!r}")


# -- DAPO's reward-side pieces (Yu et al. 2025) ---------------------------------------------------

def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int,
                     factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to each completion's reward: 0 up to
    max_len - buffer tokens, then linearly down to -factor at max_len (and -factor beyond).

    A hard penalty for truncation punishes sound reasoning that merely ran long; the ramp
    tells the policy it is approaching the limit instead. lengths: (N,) token counts."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    over = (lengths.float() - (max_len - buffer)).clamp(min=0.0)
    return -factor * (over / buffer).clamp(max=1.0)


def uniform_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Groups whose completions all scored the same, (groups, G) -> (groups,) bool: their
    group-relative advantage is zero for every estimator, so they teach nothing and, kept in a
    token-mean loss, only dilute the informative groups (DAPO's dynamic sampling drops them)."""
    return (rewards == rewards[:, :1]).all(dim=1)
