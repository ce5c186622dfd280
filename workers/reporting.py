"""The one reporting protocol every engine uses: metrics, events, samples, checkpoints, and
the question "should I stop?".

A worker's reporter sends each call to the API on the claimed run (``workers.adapters``); the
RL engine's own CLI writes JSON lines and stdout (``workers.rl.sinks``); tests keep a list.
An engine asks ``should_stop()`` at its safe points and raises :class:`Stopped`; a reporter
may also raise it from any call once the run was canceled or its lease lost. When the stop is a
preemption (``preempted()``), an engine that can resume first writes a checkpoint of its last
completed step, reporting it as usual; after a cancel or a lost lease it writes nothing, since
another worker may already own the run.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


class Stopped(Exception):
    """The run was canceled, its lease lost, or it was preempted: the engine stops where it
    is (after its preemption checkpoint, for an engine that writes one)."""


@runtime_checkable
class Reporter(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Scalar metrics at ``step`` (non-finite values may be dropped by the reporter)."""

    def event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        """A line for the run's log: ``level`` is debug, info, warning or error."""

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Generated completions: ``{"prompt", "completion", "reward"?, ...}`` rows."""

    def checkpoint(self, step: int, uri: str, metrics: dict[str, float]) -> None:
        """A checkpoint folder the engine wrote at ``uri`` (a local path)."""

    def should_stop(self) -> bool:
        """Whether the engine should stop at its next safe point."""

    def preempted(self) -> bool:
        """Whether the stop asked is a preemption (the scheduler wants the resources back):
        checkpoint the last completed step, then stop. False for a cancel or a lost lease."""


class NullReporter:
    """Reports nothing and never stops: ranks other than 0, and a base for partial ones."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        pass

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        pass

    def checkpoint(self, step: int, uri: str, metrics: dict[str, float]) -> None:
        pass

    def should_stop(self) -> bool:
        return False

    def preempted(self) -> bool:
        return False
