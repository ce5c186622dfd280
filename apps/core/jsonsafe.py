"""JSON from outside (request bodies, JSONL uploads, websocket frames), checked once at the
door so nothing deeper can fail on it with a 500.

Three things parse as JSON and still break later: nesting deep enough to exhaust Python's
recursion limit in ``json.dumps`` (saving a JSONField, hashing an idempotent request), a lone
UTF-16 surrogate (``"\\ud800"``: not encodable as UTF-8, so writing it anywhere fails), and a
NUL character (PostgreSQL's text and jsonb columns refuse it while SQLite stores it, so the
two configurations would disagree). Each is refused here with a message naming where it is.
orjson refuses surrogates and nesting beyond 1,024 levels itself; the walk below enforces the
smaller depth and finds NULs.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from django.conf import settings

DEFAULT_MAX_DEPTH = 64


class InvalidJSON(ValueError):
    """The input is not JSON Crucible accepts; the message says why and where."""


def max_depth() -> int:
    return int(settings.CRUCIBLE.get("MAX_JSON_DEPTH", DEFAULT_MAX_DEPTH))


def _orjson_depth_limit() -> int:
    """The nesting orjson accepts (1,024 in 3.x), found once by trying."""
    low, high = 1, 4096
    while low < high:
        mid = (low + high + 1) // 2
        try:
            orjson.loads(b"[" * mid + b"]" * mid)
            low = mid
        except orjson.JSONDecodeError:
            high = mid - 1
    return low


ORJSON_DEPTH_LIMIT = _orjson_depth_limit()


def loads(raw: bytes | str) -> Any:
    """Parse and check ``raw`` or raise InvalidJSON (NaN and Infinity are refused too).

    The depth limit costs nothing extra: the document is parsed inside ``k`` one-element
    arrays, where ``k`` is orjson's own limit minus ours, so orjson itself refuses anything
    deeper than ours; each wrapper must then hold exactly one value, or the text was not one
    JSON document. A walk looks for NULs only when the text holds an escape for one."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    if not data.strip():
        raise InvalidJSON("JSON parse error - the document is empty.")
    wrappers = max(0, ORJSON_DEPTH_LIMIT - max_depth())
    try:
        value = orjson.loads(b"[" * wrappers + data + b"]" * wrappers)
    except orjson.JSONDecodeError as exc:
        if "depth limit" in str(exc) and wrappers:
            try:
                orjson.loads(data)
            except orjson.JSONDecodeError:
                return _loads_slow(raw)  # broken in another way: name that
            raise InvalidJSON(f"JSON is nested deeper than {max_depth()} levels.") from exc
        return _loads_slow(raw)
    for _ in range(wrappers):
        if not isinstance(value, list) or len(value) != 1:
            return _loads_slow(raw)  # e.g. "1, 2": not one document
        value = value[0]
    if b"\\u0000" in data:
        check(value)
    return value


def _loads_slow(raw: bytes | str) -> Any:
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        text = str(exc)
        if "depth limit" in text or "recursion" in text:
            raise InvalidJSON(f"JSON is nested deeper than {max_depth()} levels.") from exc
        if "surrogate" in text:
            raise InvalidJSON(
                f"JSON holds a lone UTF-16 surrogate escape ({text}); a string must be valid "
                "Unicode (pair the surrogates, or send the character itself as UTF-8)."
            ) from exc
        # orjson refuses numbers beyond a float's range that the stdlib reads (as ints);
        # let those through so validation can name the field that is out of range.
        try:
            value = json.loads(raw, parse_constant=_refuse_constant)
        except RecursionError as deep:
            raise InvalidJSON(f"JSON is nested deeper than {max_depth()} levels.") from deep
        except ValueError as again:
            raise InvalidJSON(f"JSON parse error - {again}") from again
    check(value)
    return value


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def check(value: Any) -> None:
    """Raise InvalidJSON if ``value`` nests deeper than the limit or holds a NUL or a lone
    surrogate in any key or string. Iterative, so the check itself cannot recurse too far."""
    limit = max_depth()
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            if depth > limit:
                raise InvalidJSON(f"JSON is nested deeper than {limit} levels "
                                  f"(at {_locate(value, _too_deep(limit))}).")
            for key, child in item.items():
                if isinstance(key, str) and _bad_text(key):
                    _raise_text(value)
                if isinstance(child, dict | list):
                    stack.append((child, depth + 1))
                elif isinstance(child, str) and _bad_text(child):
                    _raise_text(value)
        elif isinstance(item, list):
            if depth > limit:
                raise InvalidJSON(f"JSON is nested deeper than {limit} levels "
                                  f"(at {_locate(value, _too_deep(limit))}).")
            for child in item:
                if isinstance(child, dict | list):
                    stack.append((child, depth + 1))
                elif isinstance(child, str) and _bad_text(child):
                    _raise_text(value)
        elif isinstance(item, str) and _bad_text(item):
            _raise_text(value)


def _bad_text(text: str) -> bool:
    """A NUL, or a lone surrogate (orjson never yields one; other callers may)."""
    return "\x00" in text or (not text.isascii() and _has_surrogate(text))


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _raise_text(value: Any) -> None:
    where = _locate(value, lambda v, _d: isinstance(v, str) and _bad_text(v), keys=True)
    raise InvalidJSON(
        f"JSON string at {where} holds a NUL character (\\u0000) or a lone surrogate, which "
        "cannot be stored; remove it (or escape it in your own encoding)."
    )


def _too_deep(limit: int):
    return lambda v, d: isinstance(v, dict | list) and d > limit


def _locate(value: Any, bad, *, keys: bool = False) -> str:
    """The path (``records[3].text``) of the first item for which ``bad(item, depth)`` holds;
    only called once something is wrong, so it may be slow. Depth-first, iterative."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "$")]
    while stack:
        item, depth, path = stack.pop()
        if bad(item, depth):
            return path
        if isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                name = f"{path}.{key}" if path != "$" else str(key)
                if keys and isinstance(key, str) and bad(key, depth):
                    return f"{name} (the key)"
                stack.append((child, depth + 1, name))
        elif isinstance(item, list):
            for index in range(len(item) - 1, -1, -1):
                stack.append((item[index], depth + 1, f"{path}[{index}]"))
    return "$"
