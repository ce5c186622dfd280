"""Usage accounting: GPU- and CPU-seconds a run held, and what became of them.

Pure arithmetic (no Django), shared by the team usage page and API and by the scheduler
benchmark's goodput figure, so both count the same way. It starts from the run's goodput
timeline (:func:`apps.runs.goodput.compute`, which splits each attempt into startup, work
kept and work redone) and multiplies each part by what the run *held* while it lasted:

- a **hold** is one allocation (GPUs of one type on one node, and CPU cores) from its
  creation to its release; with the scheduler off a run has no allocation rows, and each
  attempt holds what the run asked for (``Run.resources``) from its claim to its end;
- each instant of a hold is charged to the part of the attempt running then: ``useful``
  (steps that count), ``startup`` (the first attempt's claim → work began), ``restart``
  (a later attempt's claim → work began: reloading after a resume), ``lost_preemption`` and
  ``lost_failure`` (steps after the last checkpoint the next attempt resumed from, trained
  again), or ``held`` when no attempt ran (admitted but not yet claimed, or not yet
  released).

``allocated`` is the sum of those parts. ``idle_learner`` and ``idle_generators`` are
shares *of useful*: the step-averaged fractions the trainer reports
(``async/learner_idle``, ``async/generator_idle``) times the useful seconds. Money is
seconds / 3600 × the hourly rate of the GPU type (or of CPU cores).

Times are seconds on one clock (the web's). Windows clip every piece, so a day or a report
range counts only what was held inside it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from apps.runs.goodput import KEEPS_ALL, PREEMPTION, Attempt, CheckpointMark, compute

#: The parts of ``allocated``, in the order people read them.
PARTS = ("useful", "startup", "restart", "lost_preemption", "lost_failure", "held")
#: Shares of ``useful`` the trainer reports idle.
IDLE_PARTS = ("idle_learner", "idle_generators")
CPU = "cpu"
DAY = 86_400.0


@dataclass(frozen=True)
class Hold:
    """Resources held from ``start`` to ``end`` (None: still held)."""

    start: float
    end: float | None
    gpus: int
    cpus: float
    flavor: str  # the GPU type, or "cpu" for CPU-only work


@dataclass(frozen=True)
class Piece:
    """A stretch of one hold charged to one part."""

    part: str
    start: float
    end: float
    gpus: int
    cpus: float
    flavor: str


@dataclass
class Usage:
    """GPU- and CPU-seconds per part, GPU-seconds per GPU type, and the idle shares."""

    gpu_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    cpu_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    gpu_s_by_type: dict[str, float] = field(default_factory=dict)
    # Core-seconds of holds with no GPU (CPU and sandbox work): what the "cpu" rate prices.
    cpu_only_s: float = 0.0
    idle_gpu_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(IDLE_PARTS, 0.0))
    idle_cpu_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(IDLE_PARTS, 0.0))

    @property
    def allocated_gpu_s(self) -> float:
        return sum(self.gpu_s.values())

    @property
    def allocated_cpu_s(self) -> float:
        return sum(self.cpu_s.values())

    @property
    def goodput(self) -> float | None:
        """Useful over allocated GPU-seconds (CPU-seconds for CPU-only usage); None when
        nothing was held."""
        if self.allocated_gpu_s > 0:
            return self.gpu_s["useful"] / self.allocated_gpu_s
        if self.allocated_cpu_s > 0:
            return self.cpu_s["useful"] / self.allocated_cpu_s
        return None

    def add(self, other: Usage) -> None:
        for mine, theirs in ((self.gpu_s, other.gpu_s), (self.cpu_s, other.cpu_s),
                             (self.idle_gpu_s, other.idle_gpu_s),
                             (self.idle_cpu_s, other.idle_cpu_s),
                             (self.gpu_s_by_type, other.gpu_s_by_type)):
            for key, value in theirs.items():
                mine[key] = mine.get(key, 0.0) + value
        self.cpu_only_s += other.cpu_only_s

    def with_idle(self, learner: float | None, generators: float | None) -> Usage:
        """This usage with its idle shares set from the run's idle fractions (None: the
        run reported none, so nothing is counted idle)."""
        for part, fraction in (("idle_learner", learner), ("idle_generators", generators)):
            f = min(max(fraction or 0.0, 0.0), 1.0)
            self.idle_gpu_s[part] = self.gpu_s["useful"] * f
            self.idle_cpu_s[part] = self.cpu_s["useful"] * f
        return self


@dataclass(frozen=True)
class Cost:
    gpu: float
    cpu: float
    unpriced_gpu_s: dict[str, float]  # GPU types with no rate (and no "gpu" fallback)

    @property
    def total(self) -> float:
        return self.gpu + self.cpu


def attempt_holds(attempts: Iterable[Attempt], *, gpus: int, cpus: float, flavor: str,
                  ) -> list[Hold]:
    """Holds for a run without allocation rows (scheduler off): each attempt held what the
    run asked for from its claim to its end."""
    return [Hold(a.claimed_at, a.ended_at, gpus, cpus, flavor) for a in attempts]


def redone_steps(attempts: Sequence[Attempt], reached: Mapping[int, int | None]) -> int:
    """Steps trained twice: for each attempt that ended without keeping all its work and was
    followed by another, the steps it had reached (``reached[number]``, None: unknown) past
    the checkpoint step the next attempt resumed from. A preemption at step 70 after a
    checkpoint at 50 that the next attempt resumed from: 20."""
    ordered = sorted(attempts, key=lambda a: a.number)
    total = 0
    for a, following in zip(ordered, ordered[1:], strict=False):
        last = reached.get(a.number)
        if a.outcome in KEEPS_ALL or last is None or following.resume_step is None:
            continue
        total += max(0, last - following.resume_step)
    return total


def needs_reached(attempts: Sequence[Attempt]) -> list[Attempt]:
    """The attempts whose last step :func:`redone_steps` reads: ended, not keeping all
    their work, and followed by another."""
    ordered = sorted(attempts, key=lambda a: a.number)
    return [a for a, _ in zip(ordered, ordered[1:], strict=False)
            if a.outcome not in KEEPS_ALL and a.ended_at is not None]


def _segments(attempts: Sequence[Attempt], checkpoints: Sequence[CheckpointMark], now: float,
              finished_at: float | None) -> list[tuple[float, float, str]]:
    """(start, end, part) of every attempt's stretches, from the goodput timeline."""
    ordered = sorted(attempts, key=lambda a: a.number)
    times = {t.number: t for t in compute(ordered, checkpoints, now=now,
                                          finished_at=finished_at).attempts}
    out: list[tuple[float, float, str]] = []
    for i, a in enumerate(ordered):
        t = times[a.number]
        began = a.claimed_at + t.startup
        kept = began + t.useful
        out.append((a.claimed_at, began, "restart" if i else "startup"))
        out.append((began, kept, "useful"))
        out.append((kept, kept + t.lost,
                    "lost_preemption" if a.outcome in PREEMPTION else "lost_failure"))
    return [s for s in out if s[1] > s[0]]


def pieces(attempts: Sequence[Attempt], checkpoints: Sequence[CheckpointMark],
           holds: Sequence[Hold], *, now: float, finished_at: float | None = None,
           ) -> list[Piece]:
    """Every hold cut at the attempts' part boundaries: each piece charged to the part
    running then, or to ``held`` where no attempt ran."""
    segments = _segments(attempts, checkpoints, now, finished_at)
    out: list[Piece] = []
    for hold in holds:
        lo, hi = hold.start, hold.end if hold.end is not None else now
        cursor = lo
        for start, end, part in segments:
            a, b = max(start, lo), min(end, hi)
            if b <= a:
                continue
            if a > cursor:
                out.append(Piece("held", cursor, a, hold.gpus, hold.cpus, hold.flavor))
            out.append(Piece(part, a, b, hold.gpus, hold.cpus, hold.flavor))
            cursor = max(cursor, b)
        if hi > cursor:
            out.append(Piece("held", cursor, hi, hold.gpus, hold.cpus, hold.flavor))
    return out


def tally(parts: Iterable[Piece], lo: float | None = None, hi: float | None = None) -> Usage:
    """The pieces' GPU- and CPU-seconds inside [lo, hi) (None: unbounded)."""
    usage = Usage()
    for p in parts:
        a = p.start if lo is None else max(p.start, lo)
        b = p.end if hi is None else min(p.end, hi)
        if b <= a:
            continue
        _charge(usage, p, b - a)
    return usage


def _charge(usage: Usage, p: Piece, seconds: float) -> None:
    usage.gpu_s[p.part] += p.gpus * seconds
    usage.cpu_s[p.part] += p.cpus * seconds
    if p.gpus:
        usage.gpu_s_by_type[p.flavor] = usage.gpu_s_by_type.get(p.flavor, 0.0) + (
            p.gpus * seconds)
    else:
        usage.cpu_only_s += p.cpus * seconds


def tally_by_day(parts: Iterable[Piece], lo: float, hi: float, day: float = DAY,
                 ) -> dict[float, Usage]:
    """The pieces inside [lo, hi) per day (keyed by the day's start, epoch seconds: UTC
    midnights), each piece cut at the midnights it spans; every day of the range has a
    key, empty or not."""
    days = {start: Usage() for start, _ in day_bounds(lo, hi, day)}
    for p in parts:
        a, b = max(p.start, lo), min(p.end, hi)
        while a < b:
            key = max(lo, (a // day) * day)
            end = min(b, (a // day + 1) * day)
            _charge(days[key], p, end - a)
            a = end
    return days


def cost(usage: Usage, rates: Mapping[str, float]) -> Cost:
    """Money from hourly rates: ``rates[<GPU type>]`` per GPU-hour (``rates["gpu"]`` for
    types not listed), ``rates["cpu"]`` per core-hour of CPU-only holds (a GPU node's
    cores come with its GPU rate, as cloud GPU prices include the host). GPU-seconds of a
    type with neither are reported unpriced rather than counted as free."""
    gpu, unpriced = 0.0, {}
    for flavor, seconds in usage.gpu_s_by_type.items():
        rate = rates.get(flavor, rates.get("gpu"))
        if rate is None:
            unpriced[flavor] = seconds
        else:
            gpu += seconds / 3600.0 * rate
    return Cost(gpu=gpu, cpu=usage.cpu_only_s / 3600.0 * rates.get(CPU, 0.0),
                unpriced_gpu_s=unpriced)


def parse_rates(raw: object) -> dict[str, float]:
    """Validated hourly rates (the parsed ``CRUCIBLE_COST_PER_GPU_HOUR``): an object of
    GPU type (or "gpu", "cpu") to a finite, non-negative number."""
    if not isinstance(raw, dict):
        raise ValueError("must be a JSON object of GPU type to hourly rate, e.g. "
                         '{"H100": 2.5, "gpu": 2.0, "cpu": 0.05}')
    out: dict[str, float] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not key.strip():
            raise ValueError("a GPU type name cannot be empty")
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value) or value < 0:
            raise ValueError(f"the rate of {key!r} must be a non-negative number, not {value!r}")
        out[key.strip()] = float(value)
    return out


def day_bounds(lo: float, hi: float, day: float = DAY) -> list[tuple[float, float]]:
    """[lo, hi) cut at multiples of ``day`` seconds (UTC midnights for epoch seconds)."""
    out, start = [], lo
    while start < hi:
        end = min(hi, (start // day + 1) * day)
        out.append((start, end))
        start = end
    return out
