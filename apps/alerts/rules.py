"""Alert rule kinds, their parameters, and the conditions they test: pure functions over
plain values (no Django), unit-tested against hand-computed cases.

Metric rules look at a run's series as it is ingested; event rules at what a run's events
say happened (a lost worker, a NaN streak, a QC verdict); periodic rules at the cluster's
state (queue wait, lost nodes), evaluated by the beat.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Metric names the engines report (workers/rl/trainer.py, workers/rl/routing.py,
# workers/envs/adapter.py): the presets below read them.
REWARD_METRIC = "reward_mean"
MISMATCH_KL_METRIC = "mismatch/kl"
SANDBOX_ERROR_METRIC = "reward/verdict_sandbox_error"
EXITED_EARLY_METRIC = "reward/verdict_exited_early"

MetricName = Annotated[str, Field(min_length=1, max_length=200)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
Points = Annotated[int, Field(ge=1, le=1000)]


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WorkerLost(_Params):
    """A run's worker vanished (its lease expired, or its node's agent saw the process die)."""


class NodeLost(_Params):
    """A node stopped heartbeating. ``scope``: ``mine`` fires only for nodes holding one of
    the team's runs; ``cluster`` for any node (operators' teams)."""

    scope: Literal["mine", "cluster"] = "mine"


class QueueWait(_Params):
    """A queued run of the team has waited longer than ``seconds`` (in ``pool``, or any)."""

    seconds: Annotated[float, Field(gt=0, le=30 * 86400)] = 600.0
    pool: Literal["", "gpu", "cpu", "sandbox"] = ""


class NanStreak(_Params):
    """``streak`` consecutive training steps with a non-finite loss (the trainer skips them
    and stops at its own ``max_consecutive_nan``)."""

    streak: Annotated[int, Field(ge=1, le=1000)] = 2


class RewardCollapse(_Params):
    """The smoothed reward (EMA with ``alpha``) fell by ``drop`` — a fraction of its peak —
    after at least ``min_points`` points, looking back over the last ``window`` points."""

    metric: MetricName = REWARD_METRIC
    alpha: Annotated[float, Field(gt=0.0, le=1.0)] = 0.1
    drop: Annotated[float, Field(gt=0.0, le=10.0)] = 0.5
    min_points: Points = 10
    window: Annotated[int, Field(ge=2, le=5000)] = 500


class MetricAbove(_Params):
    """The metric's last ``for_points`` values are all above ``threshold``."""

    metric: MetricName
    threshold: float
    for_points: Points = 1


class MismatchKl(_Params):
    """Sampler/trainer mismatch KL (``mismatch/kl``) above ``bound`` for ``for_points``."""

    bound: Annotated[float, Field(gt=0.0)] = 0.01
    for_points: Points = 1


class SandboxErrorRate(_Params):
    """Share of a step's graded rollouts whose sandbox failed (``reward/verdict_sandbox_
    error``) above ``threshold`` for ``for_points`` steps."""

    threshold: Fraction = 0.1
    for_points: Points = 1


class ForgerySuspect(_Params):
    """Forgery suspicion: a QC run found known forgeries that earn reward in the team's
    environment version (the grader can be fooled), or a training run's share of candidates
    that exited before their tests finished (``reward/verdict_exited_early``, how many
    forgeries look) is above ``threshold``."""

    threshold: Fraction = 0.05


PARAMS: dict[str, type[_Params]] = {
    "worker_lost": WorkerLost,
    "node_lost": NodeLost,
    "queue_wait": QueueWait,
    "nan_streak": NanStreak,
    "reward_collapse": RewardCollapse,
    "metric_above": MetricAbove,
    "mismatch_kl": MismatchKl,
    "sandbox_error_rate": SandboxErrorRate,
    "forgery_suspect": ForgerySuspect,
}
METRIC_KINDS = frozenset({"reward_collapse", "metric_above", "mismatch_kl",
                          "sandbox_error_rate", "forgery_suspect"})
EVENT_KINDS = frozenset({"worker_lost", "nan_streak", "forgery_suspect"})
PERIODIC_KINDS = frozenset({"node_lost", "queue_wait"})


def parse_params(kind: str, raw: Any) -> dict[str, Any]:
    """The rule's parameters with defaults filled in; raises pydantic's ValidationError."""
    return PARAMS[kind].model_validate(raw if raw is not None else {}).model_dump()


def watched_metric(kind: str, params: dict[str, Any]) -> str | None:
    """The one metric a metric rule reads (None for other kinds)."""
    return {"reward_collapse": params.get("metric"), "metric_above": params.get("metric"),
            "mismatch_kl": MISMATCH_KL_METRIC, "sandbox_error_rate": SANDBOX_ERROR_METRIC,
            "forgery_suspect": EXITED_EARLY_METRIC}.get(kind)


@dataclass(frozen=True)
class Finding:
    """A condition that holds: what the alert says, and the value that tripped it."""

    message: str
    value: float | None = None


# --- pure conditions -------------------------------------------------------------------


def ema(values: Sequence[float], alpha: float) -> list[float]:
    """Exponential moving average, seeded with the first value:
    ``s0 = x0``, ``s_t = alpha * x_t + (1 - alpha) * s_{t-1}``."""
    out: list[float] = []
    for x in values:
        out.append(x if not out else alpha * x + (1.0 - alpha) * out[-1])
    return out


def smoothed_drop(values: Sequence[float], alpha: float) -> tuple[float, float, float]:
    """(peak, current, drop) of the EMA of ``values``: ``drop`` is how far the current
    smoothed value sits below the peak, as a fraction of the peak's magnitude (0 when it
    is at the peak; also 0 for an all-zero series)."""
    smooth = ema(values, alpha)
    peak, current = max(smooth), smooth[-1]
    scale = abs(peak)
    return peak, current, ((peak - current) / scale if scale > 1e-12 else 0.0)


def reward_collapse(values: Sequence[float], p: dict[str, Any]) -> Finding | None:
    tail = list(values)[-p["window"]:]
    if len(tail) < p["min_points"]:
        return None
    peak, current, drop = smoothed_drop(tail, p["alpha"])
    if drop < p["drop"]:
        return None
    return Finding(f"{p['metric']} collapsed: smoothed value {current:.4g} is {drop:.0%} "
                   f"below its peak {peak:.4g} (alert at {p['drop']:.0%})", drop)


def nan_streak(values: Sequence[float | None]) -> int:
    """How many of the last values in a row are missing or non-finite."""
    streak = 0
    for value in reversed(values):
        if value is not None and math.isfinite(value):
            break
        streak += 1
    return streak


def above_for(values: Sequence[float], threshold: float, for_points: int) -> bool:
    """The last ``for_points`` values exist and all exceed ``threshold``."""
    tail = list(values)[-for_points:]
    return len(tail) == for_points and all(v > threshold for v in tail)


def metric_finding(kind: str, p: dict[str, Any], values: Sequence[float]) -> Finding | None:
    """The metric rule ``kind`` over a run's series ``values`` (oldest first)."""
    if not values:
        return None
    if kind == "reward_collapse":
        return reward_collapse(values, p)
    metric = watched_metric(kind, p)
    threshold = {"metric_above": p.get("threshold"), "mismatch_kl": p.get("bound"),
                 "sandbox_error_rate": p.get("threshold"),
                 "forgery_suspect": p.get("threshold")}[kind]
    for_points = p.get("for_points", 1)
    assert threshold is not None
    if not above_for(values, threshold, for_points):
        return None
    what = {"mismatch_kl": "train/infer mismatch KL",
            "sandbox_error_rate": "sandbox error rate",
            "forgery_suspect": "forgery suspect: share of candidates that exited early"
            }.get(kind, str(metric))
    span = f" for {for_points} points" if for_points > 1 else ""
    return Finding(f"{what} ({metric}) = {values[-1]:.4g}, above {threshold:g}{span}",
                   values[-1])


def points_needed(kind: str, p: dict[str, Any]) -> int:
    """How many of the latest points a metric rule reads."""
    return p["window"] if kind == "reward_collapse" else p.get("for_points", 1)


def backoff_seconds(attempt: int, *, base: float, cap: float) -> float:
    """Delay before retry number ``attempt`` (1 = the first retry): doubling from ``base``,
    at most ``cap``."""
    return min(cap, base * 2.0 ** max(0, attempt - 1))
