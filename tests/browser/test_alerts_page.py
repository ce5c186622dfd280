"""The alerts page in a real browser: a viewer reaches it from the team nav and sees the
alert a rule fired (its message, its run linked), the rule and the webhook delivery's log;
from the run page the "Alerts" link shows only that run's alerts; no console error."""

from __future__ import annotations

import pytest

from apps.alerts.models import AlertRule, Delivery, DeliveryAttempt
from apps.alerts.services import fire
from apps.teams.models import Role
from tests.browser.test_run_charts import login
from tests.factories import make_lab, make_run

pytestmark = pytest.mark.slow
WAIT = 15_000


@pytest.fixture
def lab(transactional_db):
    lab = make_lab(Role.VIEWER)
    lab["run"] = make_run(lab["project"], lab["dataset"], name="grpo-nan")
    lab["quiet"] = make_run(lab["project"], lab["dataset"], name="quiet")
    rule = AlertRule.objects.create(team=lab["team"], name="nan guard", kind="nan_streak",
                                    params={"streak": 2}, webhook_url="https://hooks.example/c",
                                    webhook_secret="whsec_" + "A" * 44)
    alert = fire(rule=rule, key=f"run:{lab['run'].pk}", run_id=lab["run"].pk, value=3.0,
                 message="3 consecutive non-finite training steps in run grpo-nan")
    assert alert is not None
    delivery = Delivery.objects.get(alert=alert)
    for number, code in ((1, 500), (2, 200)):
        DeliveryAttempt.objects.create(delivery=delivery, number=number, status_code=code,
                                       response="boom" if code == 500 else "ok")
    Delivery.objects.filter(pk=delivery.pk).update(status="succeeded", attempts=2)
    return lab


def test_viewer_sees_alerts_rules_and_deliveries(asgi_server, browser, lab):
    page, errors = login(browser, asgi_server, "alice")
    page.click("header nav a:text('Alerts')")
    page.wait_for_url(f"{asgi_server}/t/lab/alerts/")
    assert page.locator("h1").inner_text() == "Alerts"
    row = page.locator("#alerts tbody tr")
    assert row.count() == 1
    assert "3 consecutive non-finite training steps" in row.inner_text()
    assert row.get_attribute("data-kind") == "nan_streak"
    assert "nan guard" in page.inner_text("#rules")
    log = page.inner_text("#deliveries")
    assert "succeeded" in log and "HTTP 500" in log and "HTTP 200" in log
    # The alert links its run; the run page links back to that run's alerts only.
    row.locator("a").click()
    page.wait_for_url(f"{asgi_server}/t/lab/runs/{lab['run'].pk}/")
    page.click("#run-alerts")
    page.wait_for_selector("#alerts", timeout=WAIT)
    assert page.locator("#alerts tbody tr").count() == 1
    page.goto(f"{asgi_server}/t/lab/runs/{lab['quiet'].pk}/")
    page.click("#run-alerts")
    page.wait_for_selector("#no-alerts", timeout=WAIT)
    assert errors == []
