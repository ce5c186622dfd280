"""Number formats of the usage page."""

from __future__ import annotations

from django import template

register = template.Library()


@register.filter
def pct(value: float | None) -> str:
    """A fraction as a percentage with one decimal; an em dash for none."""
    return "—" if value is None else f"{100.0 * value:.1f}%"


@register.filter
def hours(value: float) -> str:
    """Hours with two decimals and thousands separators."""
    return f"{value:,.2f}"


@register.filter
def money(value: float, currency: str) -> str:
    return f"{value:,.2f} {currency}"


@register.filter
def plus(value: float, other: float) -> float:
    """A float sum (Django's ``add`` truncates floats to integers first)."""
    return value + other
