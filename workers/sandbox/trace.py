"""Execution traces (Python, opt-in): turning the bootstrap's capped JSON into a Trace.

The tracer itself runs inside the sandbox (harness/python_boot.py: sys.settrace on the program's
own file only, capped in events and bytes because per-line snapshots slow code about 60x); the
host only parses and re-checks the caps, since the sandbox's output is untrusted.
"""

from __future__ import annotations

import json
from typing import Any

from .spec import Trace, TraceEvent, TraceFrame, TraceOptions

_EVENTS = {"call", "line", "return", "exception"}


def _str_dict(value: Any, max_repr: int) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {str(k)[:64]: str(v)[:max_repr] for k, v in list(value.items())[:32]}


def parse(payload: str, options: TraceOptions) -> Trace | None:
    """A Trace from the bootstrap's JSON, or None when it is malformed."""
    try:
        data = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    events: list[TraceEvent] = []
    raw_events = data.get("events") or []
    for item in raw_events[: options.max_events]:
        if not (isinstance(item, list) and len(item) >= 3 and item[0] in _EVENTS):
            continue
        locals_ = _str_dict(item[3], options.max_repr) if len(item) > 3 else None
        events.append(TraceEvent(event=item[0], function=str(item[1])[:128], line=int(item[2]),
                                 locals=locals_))
    stack = [
        TraceFrame(function=str(f[0])[:128], line=int(f[1]),
                   locals=_str_dict(f[2], options.max_repr))
        for f in (data.get("stack") or [])[:64]
        if isinstance(f, list) and len(f) == 3
    ]
    exc = data.get("exception")
    return Trace(
        events=events,
        truncated=bool(data.get("truncated")) or len(raw_events) > options.max_events,
        exception=str(exc)[:1000] if exc else None,
        stack=stack,
    )
