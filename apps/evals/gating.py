"""Comparing an evaluation with its previous version and the suite's baseline, and the
verdict that gates promotion. Pure functions (no Django), tested with hand-computed values.

A regression is an absolute drop of an entry's score (its ``pass@k`` or ``mean_reward``)
larger than the entry's threshold, against the previous version or against the baseline.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Scores are means of rewards: a drop that equals the threshold up to float rounding (0.8 -
# 0.7 is 0.10000000000000009) is not a regression.
EPSILON = 1e-9


@dataclass(frozen=True)
class Comparison:
    reference: float | None
    delta: float | None  # score - reference
    regressed: bool


def compare(score: float | None, reference: float | None, threshold: float) -> Comparison:
    """``score`` against ``reference``: nothing to say when either is missing."""
    if score is None or reference is None:
        return Comparison(reference=reference, delta=None, regressed=False)
    delta = score - reference
    return Comparison(reference=reference, delta=delta, regressed=-delta > threshold + EPSILON)


def verdict(statuses: Iterable[str], regressions: Iterable[bool]) -> str:
    """``pending`` while any entry's run has not finished, ``failed`` when one failed (no
    score to judge), ``regressed`` when any entry regressed, else ``passed``."""
    statuses = list(statuses)
    if any(s == "pending" for s in statuses):
        return "pending"
    if any(s != "succeeded" for s in statuses):
        return "failed"
    return "regressed" if any(regressions) else "passed"


@dataclass(frozen=True)
class Totals:
    capability: float | None  # mean of the entries' scores
    tasks: int
    cpu_seconds_per_task: float | None
    gpu_seconds_per_task: float | None
    latency_s: float | None  # per sample, the entries' means weighted by their tasks


@dataclass(frozen=True)
class EntryFigures:
    score: float | None
    tasks: int | None
    cpu_seconds: float | None
    gpu_seconds: float | None
    latency_s: float | None


def totals(entries: Sequence[EntryFigures]) -> Totals:
    """One evaluation's figures from its entries'; None where an entry lacks its part (an
    incomplete evaluation has no capability, cost or latency to rank by)."""
    def complete(values: list[float | None]) -> list[float] | None:
        return None if not values or any(v is None for v in values) else \
            [float(v) for v in values if v is not None]

    scores = complete([e.score for e in entries])
    tasks = sum(e.tasks or 0 for e in entries)
    cpu = complete([e.cpu_seconds for e in entries])
    gpu = complete([e.gpu_seconds for e in entries])
    lat = complete([e.latency_s for e in entries])
    weights: list[int] = [e.tasks or 0 for e in entries]
    weight = float(sum(weights))
    return Totals(
        capability=sum(scores) / len(scores) if scores else None,
        tasks=tasks,
        cpu_seconds_per_task=sum(cpu) / tasks if cpu is not None and tasks else None,
        gpu_seconds_per_task=sum(gpu) / tasks if gpu is not None and tasks else None,
        latency_s=(sum(v * w for v, w in zip(lat, weights, strict=True)) / weight)
        if lat is not None and weight else None,
    )
