"""The broker's waiting messages per queue (``crucible_broker_queue_messages`` in /metrics),
counted by a passive declare on each real transport: the filesystem spool, Redis and RabbitMQ
(the system node on 5672, which `.ci/run` starts). Messages are really published; the queue
has a name of its own per test and is deleted afterwards."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import uuid

import pytest
from django.test import Client
from kombu import Connection, Exchange, Queue

from apps.ops.broker import queue_messages
from config import env
from tests.apps.ops.test_metrics import metrics_token, scrape, value  # noqa: F401 - fixture
from tests.skips import host_skip

AMQP = "amqp://guest:guest@127.0.0.1:5672//"


def _reachable(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def broker_url(kind: str) -> str:
    if kind == "filesystem":
        return "filesystem://"
    if kind == "redis":
        url = os.environ.get("REDIS_URL", "").strip()
        if not url:
            host_skip("a Redis test: runs in the PostgreSQL + Redis pass")
        return url
    if shutil.which("rabbitmq-server") is None:
        host_skip("RabbitMQ is not installed on this host (apt-get install rabbitmq-server)")
    if not _reachable(5672):
        pytest.skip("RabbitMQ is not running on 127.0.0.1:5672: start it with "
                    "`rabbitmq-server -detached`")
    return AMQP


@pytest.mark.parametrize("kind", ["filesystem", "redis", "amqp"])
def test_messages_waiting_per_queue_on_each_transport(kind: str) -> None:
    url = broker_url(kind)
    name = f"test-depth-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
    with Connection(url, transport_options=env.broker_transport_options(url)) as conn:
        producer = conn.Producer(serializer="json")
        try:
            for i in range(3):
                producer.publish({"n": i}, exchange=queue.exchange, routing_key=name,
                                 declare=[queue])
            counts = queue_messages([name, f"{name}-never-declared"], url)
            assert counts == {name: 3, f"{name}-never-declared": 0}
            # One message taken (basic_get: exactly one, where a consumer would prefetch).
            message = queue(conn.default_channel).get(no_ack=False)
            assert message is not None and message.payload["n"] in range(3)
            message.ack()
            assert queue_messages([name], url) == {name: 2}
        finally:
            with contextlib.suppress(Exception):
                queue(conn.default_channel).delete()


def test_metrics_report_the_configured_brokers_queues(metrics_token: str, db) -> None:  # noqa: F811
    text = scrape(metrics_token)
    for pool in ("gpu", "sandbox", "cpu"):
        assert value(text, "crucible_broker_queue_messages", queue=pool) is not None, pool


def test_an_unreachable_broker_leaves_the_gauge_out_not_the_scrape(
        metrics_token: str, db, monkeypatch) -> None:  # noqa: F811
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("CELERY_BROKER_URL", f"amqp://guest:guest@127.0.0.1:{port}//")
    text = scrape(metrics_token)
    assert "crucible_broker_queue_messages" not in text
    assert value(text, "crucible_queue_depth", pool="gpu") == 0
    assert Client().get("/readyz").status_code == 503
