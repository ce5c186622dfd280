"""The RL engine's own reporters (``workers.reporting.Reporter``): a JSONL file, stdout and a
fan-out, for runs outside the platform; a worker passes its API reporter instead. Only rank 0
reports; other ranks get a ``NullSink``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from workers.jsonsafe import json_safe
from workers.reporting import NullReporter, Reporter


class JsonlSink(NullReporter):
    """Append-only JSON lines, flushed per record so a killed run loses nothing it reported."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _write(self, record: dict[str, Any]) -> None:
        record = {"time": time.time(), **record}
        with self.path.open("a") as f:
            f.write(json.dumps(json_safe(record), sort_keys=True) + "\n")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._write({"kind": "metrics", "step": step, "metrics": metrics})

    def event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        self._write({"kind": "event", "level": level, "message": message, "data": data or {}})

    def checkpoint(self, step: int, uri: str, metrics: dict[str, float]) -> None:
        self._write({"kind": "checkpoint", "step": step, "uri": uri, "metrics": metrics})

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self._write({"kind": "samples", "step": step, "samples": rows})


class StdoutSink(NullReporter):
    """One compact human-readable line per record."""

    KEYS = ("loss", "reward_mean", "kl", "entropy", "clip_frac", "lr")

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stdout

    def log(self, step: int, metrics: dict[str, float]) -> None:
        shown = {k: metrics[k] for k in self.KEYS if k in metrics}
        shown = shown or dict(list(metrics.items())[:6])
        body = " ".join(f"{k}={v:.4g}" for k, v in shown.items())
        print(f"step {step:>5} {body}", file=self.stream, flush=True)

    def event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        print(f"[{level}] {message}", file=self.stream, flush=True)

    def checkpoint(self, step: int, uri: str, metrics: dict[str, float]) -> None:
        print(f"checkpoint step={step} {uri}", file=self.stream, flush=True)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        pass  # too long for one line each; the JSONL sink and the API keep them


class MultiSink:
    """Every call to each reporter; stop when any of them says so."""

    def __init__(self, *sinks: Reporter):
        self.sinks = sinks

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for s in self.sinks:
            s.log(step, metrics)

    def event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        for s in self.sinks:
            s.event(level, message, data)

    def checkpoint(self, step: int, uri: str, metrics: dict[str, float]) -> None:
        for s in self.sinks:
            s.checkpoint(step, uri, metrics)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        for s in self.sinks:
            s.samples(step, rows)

    def should_stop(self) -> bool:
        return any(s.should_stop() for s in self.sinks)

    def preempted(self) -> bool:
        """A preemption only when no reporter asks for a plain stop (a lost lease wins)."""
        stopping = [s for s in self.sinks if s.should_stop()]
        return bool(stopping) and all(s.preempted() for s in stopping)


class NullSink(NullReporter):
    """For ranks other than 0."""


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
