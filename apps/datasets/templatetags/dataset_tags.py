"""Template filters for dataset and review pages."""

from __future__ import annotations

import json
from typing import Any

from django import template

register = template.Library()


@register.filter
def pretty_json(value: Any) -> str:
    """Indented JSON for a <pre> block (autoescaped by the template like any string)."""
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


@register.filter
def compact_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


@register.filter
def percent(value: Any, digits: int = 1) -> str:
    """0.0495 -> '4.95 %' style, for bounds and rates; '—' when missing."""
    if value is None or value == "":
        return "—"
    return f"{float(value) * 100:.{int(digits)}f}%"


@register.filter
def field_value(record: Any, name: str) -> Any:
    """A record's field for a table cell: strings as they are, anything else as compact
    JSON; None when the record lacks it."""
    if not isinstance(record, dict) or name not in record:
        return None
    value = record[name]
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
