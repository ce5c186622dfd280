"""Worker request bodies validated with the typed protocol (:mod:`workers.protocol`).

A pydantic error becomes the API's one error shape, ``{"code": "invalid", "message",
"errors"}``, with each field named as DRF would (``pool``, ``samples[0].prompt``), so a worker
sees the same 400 whichever layer refused its document.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from apps.core.exceptions import InvalidInput

M = TypeVar("M", bound=BaseModel)


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
        errors: dict[str, list[str]] = {}
        for error in exc.errors(include_url=False):
            errors.setdefault(field_name(error["loc"]), []).append(error["msg"])
        first = next(iter(errors))
        message = errors[first][0] if first == "non_field_errors" else \
            f"{first}: {errors[first][0]}"
        raise InvalidInput(message, details=errors) from exc
