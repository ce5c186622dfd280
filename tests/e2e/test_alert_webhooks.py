"""An alert's webhook through real processes: the web fires it and sends the delivery task
to the broker; a Celery worker (no database) asks the web, over HTTP, to attempt it; the
receiver's first 500 makes the task retry itself after the web's backoff, and the second
attempt succeeds. Both attempts are in the delivery log the API shows."""

from __future__ import annotations

from typing import Any

import pytest
from standardwebhooks import Webhook

from apps.alerts import services
from apps.alerts.models import AlertRule, Delivery
from apps.teams.models import Team
from tests.apps.alerts.test_webhooks import Receiver
from tests.e2e.conftest import tenant, wait_for
from workers.client import CrucibleClient

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_a_celery_worker_retries_a_failed_webhook_until_it_succeeds(
        live_server: Any, start_worker: Any, settings: Any) -> None:
    settings.CRUCIBLE = {**settings.CRUCIBLE, "WEBHOOK_ALLOW_PRIVATE": True,
                         "WEBHOOK_BACKOFF_S": 0.5, "WEBHOOK_MAX_ATTEMPTS": 4}
    token, worker_token = tenant("hooks")
    receiver = Receiver([500])
    try:
        with CrucibleClient(live_server.url, token) as client:
            rule = client.request("POST", "teams/hooks/alert-rules", json={
                "name": "lost", "kind": "worker_lost", "webhook_url": receiver.url})
        worker = start_worker(worker_token)
        team = Team.objects.get(slug="hooks")
        alert = services.fire(rule=AlertRule.objects.get(pk=rule["id"]), key="run:x",
                              message="worker w1 lost on attempt 1")
        assert alert is not None and alert.team_id == team.pk
        delivery = Delivery.objects.get(alert=alert)

        def done() -> bool:
            delivery.refresh_from_db()
            return delivery.status != "pending"

        try:
            wait_for(done, timeout=90, what="the webhook delivery")
        except AssertionError:
            worker.terminate()
            raise AssertionError(worker.communicate(timeout=10)[0][-4000:]) from None
        assert delivery.status == "succeeded"
        with CrucibleClient(live_server.url, token) as client:
            logged = client.request("GET", f"teams/hooks/webhook-deliveries/{delivery.pk}")
        assert [a["status_code"] for a in logged["log"]] == [500, 200]
        assert len(receiver.received) == 2
        for headers, body in receiver.received:
            assert Webhook(rule["webhook_secret"]).verify(body, headers)["data"]["id"] == \
                alert.pk
    finally:
        receiver.close()
