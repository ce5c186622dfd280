"""Deterministic train/eval splits: the same ids, fraction and seed always give the same split."""

from __future__ import annotations

import random
from collections.abc import Sequence


def eval_ids(ids: Sequence[str], eval_fraction: float, seed: int) -> set[str]:
    """The ids held out for evaluation: round(fraction * n), at least one when the fraction is
    positive, and at least one left for training unless the fraction is 1."""
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
    n = len(ids)
    if eval_fraction >= 1.0:
        return set(ids)
    count = min(max(round(eval_fraction * n), 1 if eval_fraction > 0 else 0), max(n - 1, 0))
    order = sorted(ids)
    random.Random(seed).shuffle(order)
    return set(order[:count])
