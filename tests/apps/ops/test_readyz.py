"""/readyz: ready only when the database answers with every migration applied and the
channel layer and broker answer; otherwise 503 naming the failing check. The failures here
are real conditions: a migration recorded as unapplied, a broker on a closed port."""

from __future__ import annotations

import socket

import pytest
from django.db import connection
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.recorder import MigrationRecorder
from django.test import Client

from apps.ops.readiness import NotReady, check_broker


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ready_names_every_check_with_its_latency(db):
    response = Client().get("/readyz")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["status"] == "ready"
    assert set(body["checks"]) == {"database", "migrations", "channel_layer", "broker"}
    for check in body["checks"].values():
        assert check["ok"] is True and check["latency_ms"] >= 0 and check["detail"]
    assert body["checks"]["database"]["detail"] == connection.vendor
    assert response["Cache-Control"].startswith("max-age=0")


def test_an_unapplied_migration_makes_the_web_not_ready(db):
    # A release whose newest sandbox migration has not been run yet (the record's deletion
    # is rolled back with the test).
    leaf = max(MigrationLoader(connection).graph.leaf_nodes("sandbox"))
    MigrationRecorder(connection).record_unapplied(*leaf)
    response = Client().get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "not ready" and body["code"] == "not_ready"
    assert body["checks"]["migrations"]["ok"] is False
    assert body["checks"]["database"]["ok"] is True
    assert body["message"].startswith("migrations: ")
    assert f"{leaf[0]}.{leaf[1]}" in body["message"] and "manage.py migrate" in body["message"]
    # /healthz (liveness) still answers: the process is fine, it just must not get traffic.
    assert Client().get("/healthz").status_code == 200


@pytest.mark.parametrize("scheme", ["redis", "amqp"])
def test_an_unreachable_broker_makes_the_web_not_ready(db, monkeypatch, scheme):
    url = f"{scheme}://127.0.0.1:{closed_port()}/"
    with pytest.raises(NotReady, match="cannot reach the Celery broker"):
        check_broker(url)
    monkeypatch.setenv("CELERY_BROKER_URL", url)
    response = Client().get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["checks"]["broker"]["ok"] is False
    assert body["message"].startswith("broker: cannot reach the Celery broker")
    assert body["checks"]["database"]["ok"] and body["checks"]["migrations"]["ok"]


def test_readyz_answers_only_reads(db):
    assert Client().post("/readyz").status_code == 405
