"""The one reporting protocol every engine uses: metrics, events, samples, checkpoints, and
the question "should I stop?".

A worker's reporter sends each call to the API on the claimed run (``workers.adapters``); the
RL engine's own CLI writes JSON lines and stdout (``workers.rl.sinks``); tests keep a list.
An engine asks ``should_stop()`` at its safe points and raises :class:`Stopped`; a reporter
may also raise it from any call once the run was canceled or its lease lost.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


class Stopped(Exception):
    """The run was canceled or its lease lost: the engine stops where it is."""


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
