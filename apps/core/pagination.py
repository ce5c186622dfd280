"""Cursor pagination everywhere: stable under concurrent inserts, O(1) per page."""

from rest_framework.pagination import CursorPagination as _Base


class CursorPagination(_Base):
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 1000
    ordering = "-created_at"
