"""Byte counts as people read them on the planner page: decimal units, as the GPU
datasheets print memory (1 GB = 10^9 bytes)."""

from __future__ import annotations

from django import template

register = template.Library()

UNITS = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))


@register.filter
def si_bytes(value: object) -> str:
    """``98304`` -> ``98.3 KB``; three significant figures, at least one decimal."""
    if not isinstance(value, int | float):
        return "—"
    for unit, size in UNITS:
        if abs(value) >= size:
            scaled = value / size
            return f"{scaled:.1f} {unit}" if scaled >= 100 else f"{scaled:.2f} {unit}"
    return f"{int(value)} B"


@register.filter
def gb(value: object) -> str:
    """Bytes as GB with two decimals (the per-GPU columns, so they line up)."""
    if not isinstance(value, int | float):
        return "—"
    return f"{value / 10**9:.2f} GB"


@register.filter
def billions(value: object) -> str:
    if not isinstance(value, int | float):
        return "—"
    if value >= 10**9:
        return f"{value / 10**9:.2f} B"
    return f"{value / 10**6:.2f} M"
