"""The Pareto front of a leaderboard: which subjects no other beats on every axis at once.

Pure functions (no Django), tested against hand-computed fronts. Hand-written: the check is
a dozen lines and the libraries that have one (pymoo, paretoset) would bring numpy-heavy
dependencies to the web process for lists of at most a few hundred rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

Sense = Literal["max", "min"]
Point = Sequence[float | None]


def _oriented(point: Point, senses: Sequence[Sense]) -> tuple[float, ...] | None:
    """The point with every axis turned into "larger is better"; None if an axis is unknown
    (an unmeasured subject is left off the front rather than guessed)."""
    if len(point) != len(senses):
        raise ValueError(f"a point has {len(point)} values for {len(senses)} axes")
    if any(v is None for v in point):
        return None
    return tuple(float(v) if s == "max" else -float(v)  # type: ignore[arg-type]
                 for v, s in zip(point, senses, strict=True))


def dominates(a: Sequence[float], b: Sequence[float]) -> bool:
    """``a`` is at least as good as ``b`` on every axis and better on one (both oriented
    "larger is better")."""
    return all(x >= y for x, y in zip(a, b, strict=True)) and \
        any(x > y for x, y in zip(a, b, strict=True))


def pareto_front(points: Sequence[Point], senses: Sequence[Sense]) -> list[bool]:
    """For each point, whether no other point dominates it. Equal points do not dominate
    each other (both stay on the front); a point with an unknown value is never on it and
    dominates nothing. O(n²) comparisons: leaderboards are small."""
    oriented = [_oriented(p, senses) for p in points]
    known = [o for o in oriented if o is not None]
    return [o is not None and not any(dominates(q, o) for q in known) for o in oriented]
