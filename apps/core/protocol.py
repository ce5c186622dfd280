"""Worker request bodies validated with the typed protocol (:mod:`workers.protocol`).

A pydantic error becomes the API's one error shape, ``{"code": "invalid", "message",
"errors"}``, with each field named as DRF would (``pool``, ``samples[0].prompt``), so a worker
sees the same 400 whichever layer refused its document.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from apps.core.exceptions import InvalidInput

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def field_name(loc: tuple[int | str, ...]) -> str:
    """``("samples", 0, "prompt")`` -> ``samples[0].prompt``."""
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or "non_field_errors"


def parse(model: type[M], data: Any) -> M:
    """``data`` as ``model``, or InvalidInput naming every bad field."""
    try:
        return model.model_validate(data if data is not None else {})
    except ValidationError as exc:
        raise invalid(exc) from exc


def parse_as(adapter: TypeAdapter[T], data: Any, *, at: str) -> T:
    """``data`` as the adapter's type (a part of a body, e.g. a batch's points), or
    InvalidInput naming every bad field under ``at``."""
    try:
        return adapter.validate_python(data)
    except ValidationError as exc:
        raise invalid(exc, at=(at,)) from exc


def invalid(exc: ValidationError, *, at: tuple[int | str, ...] = ()) -> InvalidInput:
    """The API's 400 for a pydantic error: the first field in the message, all in ``errors``."""
    errors: dict[str, list[str]] = {}
    for error in exc.errors(include_url=False, include_input=False):
        errors.setdefault(field_name(at + tuple(error["loc"])), []).append(error["msg"])
    first = next(iter(errors))
    message = errors[first][0] if first == "non_field_errors" else f"{first}: {errors[first][0]}"
    return InvalidInput(message, details=errors)
