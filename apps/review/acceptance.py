"""Acceptance sampling for spot-checked batches: how many records to review, and what the
reviewers' verdicts say about the whole batch.

The model: a batch of ``population`` records has an unknown fraction ``p`` of bad records.
Reviewers judge a simple random sample; ``rejected`` of ``reviewed`` fail. The batch is
acceptable when ``p <= target`` (the target error rate). At a stated ``confidence`` we

* **accept** when the exact (Clopper-Pearson) one-sided upper bound on ``p`` is within the
  target — equivalently ``P(X <= rejected | n=reviewed, p=target) <= 1 - confidence``;
* **reject** when the one-sided lower bound already exceeds the target —
  ``P(X >= rejected | n=reviewed, p=target) < 1 - confidence``. This may happen before the
  sample is fully reviewed (curtailed inspection: more verdicts cannot lower the bound below
  the target once it is clearly above);
* otherwise **resample**: grow the sample and review more.

When the sample is the whole batch (a census) there is nothing left to estimate: accept when
``rejected <= target * population``.

The binomial model treats the sample as drawn with replacement, which is conservative for a
finite batch (the hypergeometric spread is smaller). Looking again after a resample spends a
little of the error budget each time; the census at the end bounds the number of looks.
Pure functions, no Django: unit-tested against hand-computed values.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

Outcome = Literal["accept", "reject", "resample", "pending"]

_BISECT_STEPS = 200  # bound precision far below float epsilon


def _check(target: float, confidence: float) -> None:
    if not 0.0 < target < 1.0:
        raise ValueError(f"target error rate must be between 0 and 1 (exclusive), got {target}")
    if not 0.5 <= confidence < 1.0:
        raise ValueError(f"confidence must be in [0.5, 1), got {confidence}")


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space so large n stays finite."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    log_n_fact = math.lgamma(n + 1)
    total = 0.0
    for i in range(k + 1):
        log_term = (log_n_fact - math.lgamma(i + 1) - math.lgamma(n - i + 1)
                    + i * log_p + (n - i) * log_q)
        total += math.exp(log_term)
    return min(1.0, total)


def binomial_sf(k: int, n: int, p: float) -> float:
    """P(X >= k)."""
    return 1.0 - binomial_cdf(k - 1, n, p)


def upper_bound(rejected: int, reviewed: int, confidence: float) -> float:
    """One-sided Clopper-Pearson upper confidence bound on the failure rate."""
    _counts(rejected, reviewed)
    if rejected >= reviewed:
        return 1.0
    alpha = 1.0 - confidence
    if rejected == 0:  # closed form: (1 - p)^n = alpha
        return 1.0 - alpha ** (1.0 / reviewed)
    low, high = 0.0, 1.0  # cdf(k; n, p) falls as p grows: find where it crosses alpha
    for _ in range(_BISECT_STEPS):
        mid = (low + high) / 2
        if binomial_cdf(rejected, reviewed, mid) > alpha:
            low = mid
        else:
            high = mid
    return high


def lower_bound(rejected: int, reviewed: int, confidence: float) -> float:
    """One-sided Clopper-Pearson lower confidence bound on the failure rate."""
    _counts(rejected, reviewed)
    if rejected == 0:
        return 0.0
    alpha = 1.0 - confidence
    if rejected == reviewed:  # closed form: p^n = alpha
        return alpha ** (1.0 / reviewed)
    low, high = 0.0, 1.0  # sf(k; n, p) rises with p: find where it crosses alpha
    for _ in range(_BISECT_STEPS):
        mid = (low + high) / 2
        if binomial_sf(rejected, reviewed, mid) < alpha:
            low = mid
        else:
            high = mid
    return low


def _counts(rejected: int, reviewed: int) -> None:
    if reviewed <= 0 or not 0 <= rejected <= reviewed:
        raise ValueError(f"need 0 <= rejected <= reviewed and reviewed > 0, got "
                         f"{rejected}/{reviewed}")


def sample_size(target: float, confidence: float, *, allowed_rejections: int = 0,
                population: int | None = None) -> int:
    """Smallest sample in which ``allowed_rejections`` failures still prove the batch within
    ``target`` at ``confidence`` (the classic c=0 plan for 5 % at 95 % is 59 records; c=1
    needs 93). Capped at the population: a small batch is reviewed in full."""
    _check(target, confidence)
    if allowed_rejections < 0:
        raise ValueError("allowed_rejections must be >= 0")
    alpha = 1.0 - confidence
    if allowed_rejections == 0:
        n = math.ceil(math.log(alpha) / math.log1p(-target))
        # guard the float edge where the ratio is an integer plus rounding noise
        while n > 1 and (1.0 - target) ** (n - 1) <= alpha:
            n -= 1
    else:
        n = allowed_rejections + 1
        while binomial_cdf(allowed_rejections, n, target) > alpha:
            n += 1
            if population is not None and n >= population:
                break
    if population is not None:
        if population <= 0:
            raise ValueError("population must be positive")
        n = min(n, population)
    return n


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    reviewed: int
    rejected: int
    sample_size: int
    population: int
    target: float
    confidence: float
    upper: float | None
    lower: float | None
    next_sample_size: int | None
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


def decide(*, population: int, sample: int, reviewed: int, rejected: int, target: float,
           confidence: float) -> Decision:
    """The batch's decision given the verdicts so far on its current ``sample``."""
    _check(target, confidence)
    if not 0 < sample <= population:
        raise ValueError(f"sample must be in 1..population ({population}), got {sample}")
    if not 0 <= rejected <= reviewed <= sample:
        raise ValueError(f"need 0 <= rejected <= reviewed <= sample, got "
                         f"{rejected}/{reviewed}/{sample}")
    alpha = 1.0 - confidence

    def made(outcome: Outcome, reason: str, next_size: int | None = None) -> Decision:
        upper = upper_bound(rejected, reviewed, confidence) if reviewed else None
        lower = lower_bound(rejected, reviewed, confidence) if reviewed else None
        return Decision(outcome, reviewed, rejected, sample, population, target, confidence,
                        upper, lower, next_size, reason)

    pct, conf = f"{target:.1%}", f"{confidence:.0%}"
    if reviewed == 0:
        return made("pending", f"No verdicts yet; {sample} records to review.")
    census = sample == population
    if census and reviewed == population:
        allowed = math.floor(target * population + 1e-9)
        if rejected <= allowed:
            return made("accept", f"Every record reviewed: {rejected}/{population} rejected, "
                                  f"within {pct} (at most {allowed}).")
        return made("reject", f"Every record reviewed: {rejected}/{population} rejected, "
                              f"above {pct} (at most {allowed}).")
    if binomial_sf(rejected, reviewed, target) < alpha:
        return made("reject", f"{rejected} of {reviewed} rejected: at {conf} confidence the "
                              f"error rate is above {pct}.")
    if reviewed < sample:
        return made("pending", f"{reviewed} of {sample} reviewed, {rejected} rejected.")
    if binomial_cdf(rejected, reviewed, target) <= alpha:
        return made("accept", f"{rejected} of {reviewed} rejected: at {conf} confidence the "
                              f"error rate is within {pct}.")
    next_size = next_sample_size(sample=sample, population=population, rejected=rejected,
                                 target=target, confidence=confidence)
    return made("resample", f"{rejected} of {reviewed} rejected: inconclusive at {conf}; "
                            f"review {next_size - sample} more ({next_size} in all).", next_size)


def next_sample_size(*, sample: int, population: int, rejected: int, target: float,
                     confidence: float) -> int:
    """The grown sample after an inconclusive round: at least double, and at least the size
    that would accept with no further rejections; never beyond the batch."""
    needed = sample_size(target, confidence, allowed_rejections=rejected, population=population)
    return min(population, max(2 * sample, needed))
