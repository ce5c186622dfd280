"""What the Celery broker holds: messages waiting per queue, for ``/metrics``.

The database's queued runs (``crucible_queue_depth``) say what the control plane wants run;
the broker's counts say what the workers have not picked up yet (a pool with no worker, a node
queue nobody consumes). One passive ``queue_declare`` per queue answers on every transport
Crucible supports: AMQP (RabbitMQ's message count), Redis (the list's length) and the
filesystem spool (files in the folder). A queue the broker does not know counts 0 and is not
created (Redis forgets a queue whenever its list empties).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from kombu import Connection

from config import env

TIMEOUT_S = 2.0


def queue_messages(queues: Iterable[str], url: str | None = None) -> dict[str, int]:
    """Ready (not yet delivered) messages per queue. Raises the
    transport's error when the broker cannot be reached (the scrape then leaves the gauge
    out rather than report zeros)."""
    url = url or env.broker_url()
    counts: dict[str, int] = {}
    with Connection(url, connect_timeout=TIMEOUT_S,
                    transport_options=env.broker_transport_options(url)) as conn:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0,
                               timeout=TIMEOUT_S)
        for queue in queues:
            # A missing queue closes an AMQP channel (404): each gets a channel of its own.
            channel = conn.channel()
            try:
                _, messages, _ = channel.queue_declare(queue=queue, passive=True)
                counts[queue] = int(messages)
            except conn.channel_errors:
                counts[queue] = 0  # not declared (or, on Redis, empty)
            finally:
                with contextlib.suppress(*conn.connection_errors, *conn.channel_errors):
                    channel.close()
    return counts
