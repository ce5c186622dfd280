"""Values made safe to write as strict JSON, one rule for every writer in Crucible.

Python's ``json`` writes NaN and infinities as bare ``NaN``/``Infinity``, which strict parsers
(the control plane's included) refuse; PostgreSQL cannot store a NUL character; a JSON key must
be a string. Workers report metrics, events and samples, and engines write JSON lines, so each
used to clean values its own way and they disagreed (two wrote null for NaN, one the string
"nan", which a chart then reads as text). :func:`json_safe` is the one rule: a non-finite float
is null, a missing value. Standard library only, so both the control plane and the engines
import it.
"""

from __future__ import annotations

import math
from typing import Any


def is_finite_number(value: Any) -> bool:
    """A JSON number that fits a float and is finite: not a bool (an int subclass that JSON
    writes as ``true``), not NaN or an infinity, not an int beyond a float's range
    (``10**400`` parses from JSON but cannot be stored as a float)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def json_safe(value: Any) -> Any:
    """``value`` as strict JSON can hold it: NaN and infinities become null, NUL characters
    U+FFFD (a model may well emit one), keys strings, tuples lists, and any other object its
    ``str()``, so writing the result can never fail or be refused downstream."""
    if isinstance(value, dict):
        return {json_safe(str(k)): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd") if "\x00" in value else value
    if value is None or isinstance(value, int | bool):
        return value
    return json_safe(str(value))
