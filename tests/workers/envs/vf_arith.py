"""A `verifiers` v1 taskset defined for the tests, shaped like an installed environment package:
the module exports exactly one Taskset subclass in `__all__`."""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str
    difficulty: str = "easy"


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.split("\n")[0].strip() == self.data.answer)

    @vf.reward(weight=0.25)
    async def short(self, trace: vf.Trace) -> float:
        return float(0 < len(trace.last_reply) <= 8)

    @vf.metric
    async def chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SumTaskset(vf.Taskset[SumTask]):
    def load(self) -> Iterable[SumTask]:
        for a in range(4):
            for b in range(3):
                yield SumTask(SumData(id=f"sum-{a}-{b}", prompt=f"{a}+{b}=", answer=str(a + b),
                                      difficulty="easy" if a + b < 4 else "medium"),
                              self.config.task)


__all__ = ["SumTaskset"]
