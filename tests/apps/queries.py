"""The N+1 check shared by the apps' test_queries.py: a list's query count measured with N
rows must also bound the same list with 2N rows, so a serializer field that queries per row
(a missing select_related or prefetch) fails the test instead of slowing the page."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

AssertMaxQueries = Callable[..., AbstractContextManager[Any]]


def results(body: dict[str, Any]) -> int:
    """How many rows a paginated (or ``results``-wrapped) list returned."""
    return len(body["results"])


def assert_rows_do_not_add_queries(client: APIClient, url: str, add_rows: Callable[[], None],
                                   assert_max_num_queries: AssertMaxQueries,
                                   count: Callable[[dict[str, Any]], int] = results) -> None:
    """Call ``add_rows`` (N rows), read ``url``, call it again (2N rows) and read ``url``
    within the first read's query count; ``count`` says how many rows a response holds."""
    add_rows()
    assert client.get(url).status_code == 200  # warm per-process caches (content types)
    with CaptureQueriesContext(connection) as few:
        response = client.get(url)
    # Counted now: the log they are sliced from is cleared when the next request starts.
    queries = len(few)
    assert response.status_code == 200, response.content
    rows = count(response.json())
    assert rows > 0
    add_rows()
    with assert_max_num_queries(queries):
        response = client.get(url)
    assert response.status_code == 200, response.content
    assert count(response.json()) == 2 * rows
