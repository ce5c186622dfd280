"""Execution traces (Python, opt-in): turning the bootstrap's capped JSON into a Trace.

The tracer itself runs inside the sandbox (harness/python_boot.py: sys.settrace on the program's
own file only, capped in events and bytes because per-line snapshots slow code about 60x) and
sends its result as one by-value record (harness/wire.py); the host only checks and re-caps it,
since the sandbox's output is untrusted.
"""

from __future__ import annotations

from typing import Any

from .spec import Trace, TraceEvent, TraceFrame, TraceOptions

_EVENTS = {"call", "line", "return", "exception"}


def _str_dict(value: Any, max_repr: int) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {str(k)[:64]: str(v)[:max_repr] for k, v in list(value.items())[:32]}


def _line(value: Any) -> int | None:
    return value if type(value) is int and 0 <= value < 1 << 31 else None


def parse(data: Any, options: TraceOptions) -> Trace | None:
    """A Trace from the bootstrap's decoded record, or None when it is malformed. The program
    wrote it (the tracer runs in its process), so every field is checked and re-capped here,
    and nothing in it can make the execution fail."""
    if not isinstance(data, dict):
        return None
    events: list[TraceEvent] = []
    raw_events = data.get("events")
    raw_events = raw_events if isinstance(raw_events, list) else []
    for item in raw_events[: options.max_events]:
        if not (isinstance(item, list) and len(item) >= 3 and item[0] in _EVENTS
                and _line(item[2]) is not None):
            continue
        locals_ = _str_dict(item[3], options.max_repr) if len(item) > 3 else None
        events.append(TraceEvent(event=item[0], function=str(item[1])[:128], line=item[2],
                                 locals=locals_))
    raw_stack = data.get("stack")
    stack = [
        TraceFrame(function=str(f[0])[:128], line=f[1], locals=_str_dict(f[2], options.max_repr))
        for f in (raw_stack if isinstance(raw_stack, list) else [])[:64]
        if isinstance(f, list) and len(f) == 3 and _line(f[1]) is not None
    ]
    exc = data.get("exception")
    return Trace(
        events=events,
        truncated=bool(data.get("truncated")) or len(raw_events) > options.max_events,
        exception=str(exc)[:1000] if exc else None,
        stack=stack,
    )
