"""What an admission pass decides: the only output of `decide()` and of the baseline policy."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

QUOTA = "quota"
NO_FITTING_NODES = "no fitting nodes"
GANG_INCOMPLETE = "gang incomplete"


def behind(n: int) -> str:
    """The reason of a run that would fit now but would delay `n` runs ahead of it."""
    return f"behind {n} higher priority"


@dataclass(frozen=True, slots=True)
class Admit:
    """Start `workload_id` on exactly these nodes and GPU ids (an empty tuple for CPU work).
    When it was admitted in place of preempted runs, start it once they have stopped."""

    workload_id: str
    allocation: Mapping[str, tuple[int, ...]]
    flavor: str


@dataclass(frozen=True, slots=True)
class Preempt:
    """Ask `workload_id` to checkpoint and stop, then return it to the queue; its resources go
    to `for_workload`, which is admitted in the same decision."""

    workload_id: str
    reason: str
    for_workload: str


@dataclass(frozen=True, slots=True)
class Wait:
    """`workload_id` stays pending: why, its 1-based place in its queue, and when it is expected
    to start (None when the pass made no reservation for it)."""

    workload_id: str
    reason: str
    position: int
    estimated_start: float | None = None


Action = Admit | Preempt | Wait
