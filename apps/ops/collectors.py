"""The Prometheus collector that turns :mod:`apps.ops.selectors` into gauges at scrape time.

Every known status, pool and node state gets a series, zero included, so an alert or an HPA
on ``crucible_queue_depth{pool="gpu"}`` sees 0 rather than no data when the queue empties.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from apps.ops import broker, selectors
from apps.runs.models import Pool, RunStatus
from apps.sandbox.models import ACTIVE as SANDBOX_ACTIVE
from apps.scheduling.models import NodeState
from config.celery import QUEUES

log = logging.getLogger(__name__)


class DatabaseCollector:
    """Gauges read from the database on each scrape (about six aggregate queries)."""

    def collect(self) -> Iterator[Metric]:
        now = timezone.now()
        pools = [p.value for p in Pool]

        runs = GaugeMetricFamily("crucible_runs", "Runs by status and pool.",
                                 labels=["status", "pool"])
        counts = selectors.runs_by_state()
        for status in RunStatus:
            for pool in pools:
                runs.add_metric([status.value, pool], counts.get((status.value, pool), 0))
        yield runs

        queued = selectors.queued_by_team(now)
        depth = GaugeMetricFamily("crucible_queue_depth", "Runs queued per pool.",
                                  labels=["pool"])
        wait = GaugeMetricFamily("crucible_queue_oldest_wait_seconds",
                                 "How long the oldest queued run of the pool has waited "
                                 "(0 when none waits).", labels=["pool"])
        team_depth = GaugeMetricFamily("crucible_team_queue_depth",
                                       "Runs queued per pool and team queue.",
                                       labels=["pool", "team"])
        team_wait = GaugeMetricFamily("crucible_team_queue_oldest_wait_seconds",
                                      "How long the oldest queued run of the team's queue in "
                                      "the pool has waited.", labels=["pool", "team"])
        for pool in pools:
            rows = [r for r in queued if r.pool == pool]
            depth.add_metric([pool], sum(r.queued for r in rows))
            wait.add_metric([pool], max((r.oldest_wait_s for r in rows), default=0.0))
        for row in queued:
            team_depth.add_metric([row.pool, row.team], row.queued)
            team_wait.add_metric([row.pool, row.team], row.oldest_wait_s)
        yield from (depth, wait, team_depth, team_wait)

        stalest = selectors.stalest_run_heartbeat(now)
        beats = GaugeMetricFamily(
            "crucible_run_heartbeat_age_max_seconds",
            "Seconds since the stalest claimed or running run's worker renewed its lease "
            "(0 when the pool runs nothing); at the lease length the sweep requeues it.",
            labels=["pool"])
        for pool in pools:
            beats.add_metric([pool], stalest.get(pool, 0.0))
        yield beats

        node_rows = selectors.nodes(now)
        age = GaugeMetricFamily("crucible_node_heartbeat_age_seconds",
                                "Seconds since each node's agent last heartbeat.",
                                labels=["node", "pool", "state"])
        by_state = GaugeMetricFamily("crucible_nodes", "Nodes by pool and state.",
                                     labels=["pool", "state"])
        for node in node_rows:
            age.add_metric([node.name, node.pool, node.state], node.heartbeat_age_s)
        for pool in pools:
            for state in NodeState:
                by_state.add_metric([pool, state.value], sum(
                    1 for n in node_rows if n.pool == pool and n.state == state.value))
        yield from (age, by_state)

        active = selectors.sandbox_active()
        sandbox = GaugeMetricFamily("crucible_sandbox_executions_active",
                                    "Sandbox executions queued or running.", labels=["status"])
        for execution_status in SANDBOX_ACTIVE:
            sandbox.add_metric([execution_status.value], active.get(execution_status.value, 0))
        yield sandbox


class BrokerCollector:
    """Messages waiting in the broker per pool queue, read at scrape time (one connection,
    one passive declare per queue). An unreachable broker leaves the gauge out of the scrape
    (and ``/readyz`` says why) instead of failing the whole scrape or reporting zeros."""

    def collect(self) -> Iterator[Metric]:
        try:
            counts = broker.queue_messages(QUEUES)
        except Exception as exc:
            log.warning("broker queue depth unavailable: %s", exc)
            return
        gauge = GaugeMetricFamily("crucible_broker_queue_messages",
                                  "Messages waiting in the Celery broker per queue (not yet "
                                  "delivered to a worker).", labels=["queue"])
        for queue, messages in counts.items():
            gauge.add_metric([queue], messages)
        yield gauge
