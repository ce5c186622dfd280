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
