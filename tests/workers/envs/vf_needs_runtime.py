"""A verifiers taskset whose reward needs a runtime (a container): Crucible must refuse it."""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf


class BoxTask(vf.Task[vf.TaskData]):
    @vf.reward
    async def file_exists(self, trace: vf.Trace, runtime: vf.Runtime) -> float:
        return 1.0


class BoxTaskset(vf.Taskset[BoxTask]):
    def load(self) -> Iterable[BoxTask]:
        yield BoxTask(vf.TaskData(id="x", prompt="make a file"), self.config.task)


__all__ = ["BoxTaskset"]
