"""Goodput: how much of a run's wall time went into work that survives.

Pure arithmetic on attempt timelines (no Django), so cost accounting (GPU/CPU-seconds
allocated, used and lost per run and team) can reuse the same numbers by multiplying them by
what each attempt held. Times are seconds on one clock (the web's: claims, attempt ends and
checkpoint registrations are all stamped there, so a worker's clock skew cannot bend them).

An attempt's span, from its claim to its end (or ``now`` while active), splits into:

- **startup**: claim → the worker said it began work (``started_at``: the claim answered,
  the sandbox probed, the checkpoint and model fetched); all of it when it never began;
- **useful**: work that survives. A succeeded or canceled attempt, or the active one,
  keeps all its work; an attempt that ended otherwise (lost, failed, preempted, drained)
  keeps its work up to its last resumable checkpoint that the next attempt could resume
  from (a step at or below the next attempt's ``resume_step``), since the steps after it are
  trained again;
- **lost**: the rest, charged to ``preemption`` (preempted, drained: the platform's choice)
  or ``failure`` (lost worker, failed attempt).

``queued`` is the time between attempts (and after the last one until the run finished or
``now``). The parts add up to ``wall``, which runs from the first claim (the run's first
admission to a worker, not its creation) to its finish (or ``now``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

KEEPS_ALL = frozenset({"active", "succeeded", "canceled"})
PREEMPTION = frozenset({"preempted", "drained"})


@dataclass(frozen=True)
class Attempt:
    number: int
    outcome: str
    claimed_at: float
    ended_at: float | None = None  # None: still active
    started_at: float | None = None  # when work began after startup; None: never (or unknown)
    resume_step: int | None = None  # the checkpoint step the attempt resumed from (0: fresh)


@dataclass(frozen=True)
class CheckpointMark:
    step: int
    created_at: float
    resumable: bool = True


@dataclass(frozen=True)
class AttemptTime:
    number: int
    outcome: str
    startup: float
    useful: float
    lost: float


@dataclass(frozen=True)
class Goodput:
    wall: float
    useful: float
    queued: float
    startup: float
    preemption: float
    failure: float
    attempts: list[AttemptTime] = field(default_factory=list)

    @property
    def goodput(self) -> float | None:
        """Useful over wall time; None before the first claim."""
        return self.useful / self.wall if self.wall > 0 else None

    @property
    def percent(self) -> float | None:
        value = self.goodput
        return None if value is None else 100.0 * value

    def as_dict(self) -> dict[str, object]:
        return {
            "goodput": self.goodput, "wall_s": self.wall, "useful_s": self.useful,
            "queued_s": self.queued, "startup_s": self.startup,
            "lost_preemption_s": self.preemption, "lost_failure_s": self.failure,
            "attempts": [{"number": a.number, "outcome": a.outcome, "startup_s": a.startup,
                          "useful_s": a.useful, "lost_s": a.lost} for a in self.attempts],
        }


def _kept_until(attempt: Attempt, start: float, end: float, next_resume: int | None,
                checkpoints: Sequence[CheckpointMark]) -> float:
    """The end of the attempt's work that survives (``start`` when none does)."""
    if attempt.outcome in KEEPS_ALL:
        return end
    marks = [c.created_at for c in checkpoints
             if c.resumable and start <= c.created_at <= end
             and (next_resume is None or c.step <= next_resume)]
    return max(marks, default=start)


def compute(attempts: Sequence[Attempt], checkpoints: Sequence[CheckpointMark], *,
            now: float, finished_at: float | None = None) -> Goodput:
    """The run's goodput from its attempts (any order) and its checkpoints' registrations.
    ``finished_at``: when the run reached a final status (None: it has not; ``now`` ends
    the wall time)."""
    ordered = sorted(attempts, key=lambda a: a.number)
    if not ordered:
        return Goodput(wall=0.0, useful=0.0, queued=0.0, startup=0.0, preemption=0.0,
                       failure=0.0)
    first = ordered[0].claimed_at
    stop = finished_at if finished_at is not None else now
    rows: list[AttemptTime] = []
    queued = preemption = failure = 0.0
    previous_end: float | None = None
    for i, attempt in enumerate(ordered):
        end = attempt.ended_at if attempt.ended_at is not None else now
        if previous_end is not None:
            queued += max(0.0, attempt.claimed_at - previous_end)
        previous_end = end
        start = attempt.started_at if attempt.started_at is not None else end
        start = min(max(start, attempt.claimed_at), end)
        later = ordered[i + 1] if i + 1 < len(ordered) else None
        kept = _kept_until(attempt, start, end, later.resume_step if later else None,
                           checkpoints)
        row = AttemptTime(number=attempt.number, outcome=attempt.outcome,
                          startup=start - attempt.claimed_at, useful=kept - start,
                          lost=end - kept)
        if attempt.outcome in PREEMPTION:
            preemption += row.lost
        else:
            failure += row.lost
        rows.append(row)
    assert previous_end is not None
    queued += max(0.0, stop - previous_end)
    return Goodput(wall=stop - first, useful=sum(r.useful for r in rows), queued=queued,
                   startup=sum(r.startup for r in rows), preemption=preemption,
                   failure=failure, attempts=rows)
