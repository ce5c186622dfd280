"""A `verifiers` v1 taskset whose task data names each task's split (a package shipping its
own held-out set), for the tests: 10 tasks, ids 6-9 held out as "test"."""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf


class EchoData(vf.TaskData):
    answer: str
    split: str


class EchoTask(vf.Task[EchoData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class EchoTaskset(vf.Taskset[EchoTask]):
    def load(self) -> Iterable[EchoTask]:
        for i in range(10):
            split = "test" if i >= 6 else "train"
            yield EchoTask(EchoData(id=f"e{i}", prompt=f"say {i}", answer=str(i), split=split),
                           self.config.task)


__all__ = ["EchoTaskset"]
