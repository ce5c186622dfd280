"""A faster JSON parser for request bodies: metric batches are parsed on every call, and
orjson takes a fifth of the stdlib's time. Same strictness (no NaN/Infinity) and the same
400 on malformed input as DRF's own parser."""

from __future__ import annotations

import json
from typing import Any

import orjson
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser


class FastJSONParser(JSONParser):
    def parse(self, stream: Any, media_type: str | None = None,
              parser_context: dict | None = None) -> Any:
        if stream is None:
            return None
        raw = stream.read()
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
        # orjson refuses integers beyond 64 bits that the stdlib reads; let those through
        # so validation can name the field that is out of range.
        try:
            return json.loads(raw, parse_constant=_refuse_constant)
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from exc


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")
