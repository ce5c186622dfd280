"""The seeded random sample of a batch that reviewers see.

The sample is a prefix of a seeded random permutation of the batch's record positions, so
growing it (a resample) keeps every record already drawn and adds new ones, and the same
seed always gives the same records.
"""

from __future__ import annotations

import random


def sample_indices(*, seed: int, population: int, size: int) -> list[int]:
    """The first ``size`` positions of a seeded shuffle of ``range(population)``.

    A partial Fisher-Yates shuffle over a sparse map: O(size) time and memory whatever the
    population, and ``sample_indices(size=n)`` is a prefix of ``sample_indices(size=m)``
    for n <= m.
    """
    if population < 0 or not 0 <= size <= population:
        raise ValueError(f"need 0 <= size <= population, got size={size}, "
                         f"population={population}")
    rng = random.Random(seed)
    moved: dict[int, int] = {}
    drawn = []
    for i in range(size):
        j = rng.randrange(i, population)
        drawn.append(moved.get(j, j))
        moved[j] = moved.get(i, i)
    return drawn
