"""Template helpers for the dashboard: query strings for sort and page links, and
values that may be missing from a compared config or report."""

from __future__ import annotations

import json
from typing import Any

from django import template

from apps.runs.dashboard import MISSING, RunFilters

register = template.Library()


@register.filter
def sort_query(filters: RunFilters, key: str) -> str:
    """Clicking the sorted column flips its direction; another column sorts descending."""
    current = filters.sort.lstrip("-")
    desc = filters.sort.startswith("-")
    target = key if (current == key and desc) else f"-{key}"
    return filters.query(sort=target, page=1)


@register.filter
def page_query(filters: RunFilters, number: int) -> str:
    return filters.query(page=number)


@register.filter
def show(value: Any) -> str:
    """A config or report value for a table cell: JSON for structures, — when absent."""
    if value is MISSING:
        return "—"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, str):
        return value
    return json.dumps(value)


@register.filter
def get_item(mapping: dict, key: str) -> Any:
    return mapping.get(key, "") if isinstance(mapping, dict) else ""


@register.filter
def duration(seconds: float | None) -> str:
    """``4 min 12 s``, ``2 h 05 min``: two units at most, the way people read elapsed time."""
    if seconds is None:
        return "—"
    total = int(round(float(seconds)))
    if total < 60:
        return f"{total} s"
    minutes, sec = divmod(total, 60)
    if minutes < 60:
        return f"{minutes} min {sec:02d} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes:02d} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours:02d} h"


@register.filter
def num(value: float | None, digits: int = 3) -> str:
    """A measured value with ``digits`` decimals (SI prefix from 10,000 up); — when absent."""
    if value is None:
        return "—"
    value = float(value)
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e4, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.{max(1, int(digits) - 1)}f}{prefix}"
    return f"{value:.{int(digits)}f}"


@register.filter
def signed(value: float | None, digits: int = 3) -> str:
    """``+0.150`` / ``−0.050`` for a change."""
    if value is None:
        return "—"
    text = f"{abs(float(value)):.{int(digits)}f}"
    return ("+" if value >= 0 else "−") + text


@register.filter
def basename(uri: str) -> str:
    """The last path segment of a URI (``…/checkpoints/step-6.tar`` → ``step-6.tar``)."""
    return str(uri).rstrip("/").rsplit("/", 1)[-1] or str(uri)


@register.filter
def run_seconds(run: Any, now: Any) -> float | None:
    """Seconds a run has run: start to finish, or to now while it runs."""
    if not getattr(run, "started_at", None):
        return None
    return ((run.finished_at or now) - run.started_at).total_seconds()
