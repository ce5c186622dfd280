"""Where a run reports to. The control plane adapts its API client to `MetricSink`; the engine
ships a JSONL-file sink, a stdout sink and a fan-out. Only rank 0 reports."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO, runtime_checkable

from workers.jsonsafe import json_safe


@runtime_checkable
class MetricSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None: ...

    def checkpoint(self, step: int, uri: str, metrics: dict[str, float]) -> None: ...


@runtime_checkable
class SampleSink(Protocol):
    """A sink that also takes RL samples (optional: the engine checks for it)."""

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None: ...


class JsonlSink:
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


class StdoutSink:
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
    def __init__(self, *sinks: MetricSink):
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
            if isinstance(s, SampleSink):
                s.samples(step, rows)


class NullSink:
    """For ranks other than 0."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        pass

    def checkpoint(self, step: int, uri: str, metrics: dict[str, float]) -> None:
        pass

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        pass


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
