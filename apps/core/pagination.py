"""Cursor pagination everywhere: stable under concurrent inserts, O(1) per page. A bad
``page_size`` is a 400 naming it, not silently the default."""

from __future__ import annotations

from typing import Any

from rest_framework.pagination import CursorPagination as _Base

from apps.core.exceptions import InvalidInput


class CursorPagination(_Base):
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 1000
    ordering = "-created_at"

    def get_page_size(self, request: Any) -> int:
        raw = request.query_params.get(self.page_size_query_param)
        if raw is None:
            return self.page_size
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if not 1 <= value <= self.max_page_size:
            raise InvalidInput(
                f"page_size must be an integer from 1 to {self.max_page_size}; got "
                f"{raw[:30]!r}.", details={"page_size": [raw[:30]]})
        return value

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        params = super().get_schema_operation_parameters(view)
        for param in params:
            if param["name"] == self.page_size_query_param:
                param["schema"] = {"type": "integer", "minimum": 1,
                                   "maximum": self.max_page_size}
        return params
