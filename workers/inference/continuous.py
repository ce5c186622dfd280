"""The served policy's continuous engine: the RL engine's continuous scheduler
(`workers.rl.continuous`, the same one training rollouts run on) over a loaded `Policy`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from workers.inference.quantize import is_quantized
from workers.rl.continuous import PREFIX_BLOCK, ContinuousScheduler, PrefixCache, SlotCache
from workers.rl.lean import supported

if TYPE_CHECKING:
    from workers.inference.engine import Policy

__all__ = ["PREFIX_BLOCK", "ContinuousBatcher", "PrefixCache", "SlotCache", "can_serve"]


def can_serve(model: torch.nn.Module) -> bool:
    """Whether the continuous engine computes exactly what the model's forward does (its lean
    forward reads float weights, so an int8 model takes the static path)."""
    return supported(model) and not is_quantized(model)


class ContinuousBatcher(ContinuousScheduler):
    """The scheduler over a policy's model, its tokenizer and its served context."""

    def __init__(self, policy: Policy, max_rows: int = 64, *, prefill_chunk: int = 512,
                 prefix_cache_tokens: int = 16384, prefix_caching: bool = True) -> None:
        self.policy = policy
        super().__init__(policy.model, policy.tok, policy.context, max_rows,
                         prefill_chunk=prefill_chunk, prefix_cache_tokens=prefix_cache_tokens,
                         prefix_caching=prefix_caching)
