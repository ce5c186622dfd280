"""Webhook delivery against a real HTTP receiver (a server thread on loopback, allowed by the
test's setting only): Standard Webhooks headers that the standardwebhooks verifier accepts,
a 500 retried after the backoff and then a success, both in the delivery log; giving up
after the last attempt; no redirects followed; private hosts refused at send time too."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.utils import timezone
from standardwebhooks import Webhook, WebhookVerificationError

from apps.alerts import services
from apps.alerts.models import Alert, Delivery
from tests.apps.alerts.test_evaluation import Claimed


class Receiver:
    """A webhook endpoint answering with the scripted statuses (then 200), keeping what it
    received."""

    def __init__(self, statuses: list[int], location: str = "", host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.statuses = list(statuses)
        self.received: list[tuple[dict[str, str], bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.received.append((dict(self.headers.items()), body))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                reply = b"boom: the receiver failed" if status >= 500 else b"ok"
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://{host}:{self.port}/hooks/crucible"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fast(settings: Any) -> None:
    """Loopback allowed (the receiver), and retries due at once."""
    settings.CRUCIBLE = {**settings.CRUCIBLE, "WEBHOOK_ALLOW_PRIVATE": True,
                         "WEBHOOK_BACKOFF_S": 0.01, "WEBHOOK_BACKOFF_CAP_S": 0.02,
                         "WEBHOOK_MAX_ATTEMPTS": 3, "WEBHOOK_TIMEOUT_S": 5.0}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver([500])
    yield r
    r.close()


@pytest.fixture
def hooks(django_capture_on_commit_callbacks: Any) -> Any:
    return lambda: django_capture_on_commit_callbacks(execute=True)


def _fire(worker: Any, project: Any, member: Any, hooks: Any, url: str) -> tuple[str, Delivery]:
    r = member.client.post("/api/v1/teams/acme/alert-rules", {
        "name": "nan", "kind": "nan_streak", "webhook_url": url}, format="json")
    assert r.status_code == 201, r.content
    secret = r.json()["webhook_secret"]
    Claimed(worker, project, hooks).event("non-finite", nan_streak=3)
    return secret, Delivery.objects.get()


class Pool:
    """The worker API as the delivery task calls it (an operator token)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def attempt_delivery(self, delivery_id: int) -> dict[str, Any]:
        r = self.worker.post(f"/api/v1/worker/alerts/deliveries/{delivery_id}/attempt")
        assert r.status_code == 200, r.content
        return dict(r.json())


@pytest.fixture
def pool(worker: Any) -> Pool:
    return Pool(worker)


def _drive(pool: Pool, delivery: Delivery, limit: int = 10) -> list[dict[str, Any]]:
    """What the Celery task does: attempt, and again after ``retry_in`` while pending."""
    outs = []
    for _ in range(limit):
        out = pool.attempt_delivery(delivery.pk)
        outs.append(out)
        if not (out["attempted"] and out["status"] == "pending"):
            break
        time.sleep(out["retry_in"])
    return outs


def test_a_500_is_retried_then_the_success_is_logged_and_signed(
        worker, pool, project, member, viewer, receiver, fast, hooks):
    secret, delivery = _fire(worker, project, member, hooks, receiver.url)
    outs = _drive(pool, delivery)
    assert [o["status"] for o in outs] == ["pending", "succeeded"]
    assert outs[0]["retry_in"] == 0.01
    # Two requests, one message: the same webhook-id, each signed and verifiable.
    assert len(receiver.received) == 2
    ids = {headers["webhook-id"] for headers, _ in receiver.received}
    assert ids == {delivery.msg_id}
    alert = Alert.objects.get()
    for headers, body in receiver.received:
        event = Webhook(secret).verify(body, headers)
        assert event["type"] == "alert.fired"
        assert event["data"]["id"] == alert.pk and event["data"]["team"] == "acme"
        assert event["data"]["rule"]["kind"] == "nan_streak"
        assert event["data"]["run"] == str(alert.run_id)
    headers, body = receiver.received[0]
    with pytest.raises(WebhookVerificationError):
        Webhook(services.new_secret()).verify(body, headers)  # another secret: refused
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(body.replace(b"acme", b"evil"), headers)  # tampered body
    # The delivery log, as the API shows it to any member of the team.
    got = viewer.client.get(f"/api/v1/teams/acme/webhook-deliveries/{delivery.pk}").json()
    assert got["status"] == "succeeded" and got["attempts"] == 2
    assert [(a["number"], a["status_code"]) for a in got["log"]] == [(1, 500), (2, 200)]
    assert got["log"][0]["response"] == "boom: the receiver failed"
    assert got["log"][1]["response"] == "ok" and got["last_status_code"] == 200
    # A late duplicate of the task finds nothing to do.
    assert pool.attempt_delivery(delivery.pk) == {"status": "succeeded", "attempted": False,
                                                  "retry_in": None}
    assert len(receiver.received) == 2


def test_gives_up_after_the_last_attempt(worker, pool, project, member, fast, hooks):
    failing = Receiver([503, 503, 503, 503])
    try:
        _, delivery = _fire(worker, project, member, hooks, failing.url)
        outs = _drive(pool, delivery)
    finally:
        failing.close()
    assert [o["status"] for o in outs] == ["pending", "pending", "failed"]
    delivery.refresh_from_db()
    assert delivery.attempts == 3 and delivery.finished_at is not None
    assert [a.status_code for a in delivery.log.order_by("number")] == [503, 503, 503]


def test_a_task_that_is_early_does_not_send(worker, pool, project, member, fast, hooks,
                                            receiver):
    _, delivery = _fire(worker, project, member, hooks, receiver.url)
    Delivery.objects.filter(pk=delivery.pk).update(
        next_attempt_at=timezone.now() + timedelta(minutes=5))
    out = pool.attempt_delivery(delivery.pk)
    assert out["attempted"] is False and out["status"] == "pending" and out["retry_in"] > 200
    assert receiver.received == []
    # Overdue past the grace period: the periodic pass sends it again.
    Delivery.objects.filter(pk=delivery.pk).update(
        next_attempt_at=timezone.now() - timedelta(minutes=5))
    assert services.resend_stalled() == [delivery.pk]


def test_redirects_are_not_followed(worker, pool, project, member, fast, hooks):
    target = Receiver([])
    redirecting = Receiver([302, 302, 302], location=target.url)
    try:
        _, delivery = _fire(worker, project, member, hooks, redirecting.url)
        _drive(pool, delivery)
    finally:
        redirecting.close()
        target.close()
    assert target.received == []
    delivery.refresh_from_db()
    assert delivery.status == "failed" and delivery.last_status_code == 302


def test_the_address_checked_is_the_address_connected(worker, pool, project, member, fast,
                                                      hooks, monkeypatch):
    """DNS rebinding: the name resolves to the allowed receiver when checked and to an
    internal service on the next lookup. The POST must reach the checked address (with the
    name in its Host header), never the internal one. Only DNS is scripted here (this
    machine has no resolver to rebind); both receivers are real servers."""
    import socket

    checked = Receiver([])
    try:
        internal = Receiver([], host="127.0.0.2", port=checked.port)
    except OSError:
        checked.close()
        pytest.skip("127.0.0.2 is not a loopback address on this host")
    real_getaddrinfo = socket.getaddrinfo
    lookups: list[str] = []

    def rebinding(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != "hooks.rebind.test":
            return real_getaddrinfo(host, port, *args, **kwargs)
        answer = "127.0.0.1" if not lookups else "127.0.0.2"
        lookups.append(answer)
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "",
                 (answer, port or 80))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    url = f"http://hooks.rebind.test:{checked.port}/hooks/crucible"
    try:
        _, delivery = _fire(worker, project, member, hooks, url)
        lookups.clear()  # the rule's own check at creation: the send is what matters
        out = pool.attempt_delivery(delivery.pk)
    finally:
        checked.close()
        internal.close()
    assert out["status"] == "succeeded", list(delivery.log.values("status_code", "error"))
    assert internal.received == []
    assert len(checked.received) == 1
    sent = {k.lower(): v for k, v in checked.received[0][0].items()}
    assert sent["host"] == f"hooks.rebind.test:{checked.port}"
    assert lookups == ["127.0.0.1"]  # looked up once, by the check


def test_a_private_host_is_refused_at_send_time_too(worker, pool, project, member, fast,
                                                    hooks, receiver, settings):
    _, delivery = _fire(worker, project, member, hooks, receiver.url)
    settings.CRUCIBLE = {**settings.CRUCIBLE, "WEBHOOK_ALLOW_PRIVATE": False}
    out = pool.attempt_delivery(delivery.pk)
    assert out["attempted"] and out["status"] == "pending"
    attempt = delivery.log.get()
    assert attempt.status_code is None and attempt.error.startswith("refused:")
    assert receiver.received == []


def test_deliveries_of_other_teams_are_404(worker, project, member, outsider, fast, hooks,
                                           receiver):
    _, delivery = _fire(worker, project, member, hooks, receiver.url)
    c = outsider.client
    assert c.get(f"/api/v1/teams/acme/webhook-deliveries/{delivery.pk}").status_code == 404
    assert c.get(f"/api/v1/teams/rival/webhook-deliveries/{delivery.pk}").status_code == 404
    assert c.get("/api/v1/teams/rival/webhook-deliveries").json()["results"] == []
