"""Prometheus instruments kept in the web process, and the registry a scrape reads.

Most of what ``/metrics`` shows is read from the database when it is scraped (apps/ops):
every web process then answers the same. Three things happen in a request and leave no row
to count, so they are in-process instruments here: request latency (no row at all), points
ingested and sandbox verdicts (counting their rows at every scrape would scan tables that
only grow). Under several web processes these need prometheus-client's multiprocess mode:
``PROMETHEUS_MULTIPROC_DIR`` set to an empty folder before each process starts (see
docs/operations.md); without it each process reports only its own counts.

Core imports no app, so the instruments live here and the apps' services increment them.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.db import transaction
from django.http import HttpRequest, HttpResponseBase
from django.utils.decorators import sync_and_async_middleware
from prometheus_client import CollectorRegistry, Counter, Histogram, multiprocess
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

#: The in-process instruments (not the global default registry: tests and a multiprocess
#: scrape build their own exposition from it and the database collector).
REGISTRY = CollectorRegistry(auto_describe=True)

REQUEST_LATENCY = Histogram(
    "crucible_http_request_duration_seconds",
    "Time from the request reaching Django to its response (headers of a streamed one), by "
    "URL name, method and status class.",
    ["view", "method", "status"], registry=REGISTRY,
)
METRIC_POINTS = Counter(
    "crucible_metric_points_ingested",
    "Metric points stored by the ingest API (a replayed batch stores nothing and counts "
    "nothing); rate() of it is the ingest rate.", registry=REGISTRY,
)
METRIC_BATCHES = Counter(
    "crucible_metric_batches_ingested",
    "Metric batches received, by outcome (stored, duplicate: a retried seq).",
    ["outcome"], registry=REGISTRY,
)
SANDBOX_FINISHED = Counter(
    "crucible_sandbox_executions_finished",
    "Sandbox executions finished, by status (done: the sandbox ran; error: the platform "
    "failed, lost: the worker vanished) and the program's verdict (OK, TLE, RE, ...).",
    ["status", "verdict"], registry=REGISTRY,
)
RUN_GOODPUT = Histogram(
    "crucible_run_goodput",
    "Goodput of train runs as they succeed: time on work that survives over wall time since "
    "the first claim (apps.runs.goodput; the run API has the breakdown).",
    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0), registry=REGISTRY,
)

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_LABEL = re.compile(r"^[A-Za-z0-9_:.\-]{1,100}$")


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class _Forward:
    """Exposes another registry's samples through a scrape-time registry."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterable[Metric]:
        return self.source.collect()


def exposition_registry(*collectors: Collector) -> CollectorRegistry:
    """A registry for one scrape: every process's instruments (multiprocess mode: read from
    the shared folder) or this process's, plus ``collectors`` (read at scrape time)."""
    registry = CollectorRegistry(auto_describe=False)
    if multiprocess_dir():
        multiprocess.MultiProcessCollector(registry)
    else:
        registry.register(_Forward(REGISTRY))
    for collector in collectors:
        registry.register(collector)
    return registry


def count_on_commit(counter: Any, amount: float = 1.0) -> None:
    """Increment once the surrounding transaction commits (a rolled-back write counts
    nothing); at once outside a transaction."""
    transaction.on_commit(lambda: counter.inc(amount))


def safe_label(value: object, default: str = "other") -> str:
    """A label value from data a client sent, kept to a short token so a caller cannot grow
    the series count without bound."""
    text = str(value) if value is not None else ""
    return text if _LABEL.match(text) else default


def _observe(request: HttpRequest, response: HttpResponseBase, seconds: float) -> None:
    match = getattr(request, "resolver_match", None)
    view = (match.view_name or "unnamed") if match is not None else "unresolved"
    method = request.method if request.method in METHODS else "other"
    REQUEST_LATENCY.labels(view, method, f"{response.status_code // 100}xx").observe(seconds)


@sync_and_async_middleware
def request_metrics(
    get_response: Callable[[HttpRequest], Any],
) -> Callable[[HttpRequest], Any]:
    """Time every request into ``crucible_http_request_duration_seconds``. Labelled by URL
    name, not path, so ids in paths do not multiply series; requests no URL matched (static
    files, 404s) share ``unresolved``. Sync and async, so it adds no thread hop under ASGI."""
    if iscoroutinefunction(get_response):
        async_get: Callable[[HttpRequest], Awaitable[HttpResponseBase]] = get_response

        async def middleware(request: HttpRequest) -> HttpResponseBase:
            start = time.perf_counter()
            response = await async_get(request)
            _observe(request, response, time.perf_counter() - start)
            return response

        return markcoroutinefunction(middleware)

    def sync_middleware(request: HttpRequest) -> HttpResponseBase:
        start = time.perf_counter()
        response = get_response(request)
        _observe(request, response, time.perf_counter() - start)
        return response

    return sync_middleware
