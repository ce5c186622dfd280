"""The JSON parser for request bodies: orjson (metric batches are parsed on every call, and
it takes a fifth of the stdlib's time), then the checks of :mod:`apps.core.jsonsafe` (depth,
NUL, lone surrogates), so a body that would fail deeper down is a 400 naming the problem.
NaN and Infinity are refused, as by DRF's own strict parser."""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

from apps.core import jsonsafe


class FastJSONParser(JSONParser):
    def parse(self, stream: Any, media_type: str | None = None,
              parser_context: dict | None = None) -> Any:
        if stream is None:
            return None
        try:
            return jsonsafe.loads(stream.read())
        except jsonsafe.InvalidJSON as exc:
            raise ParseError(str(exc)) from exc
