"""The queue page in a real browser, after a real admission pass with the scheduler on: from
the cluster page's link, a person reads each queue's runs in order with what they ask for, why
they wait (the reason the pass wrote) and the node an admitted run starts on; another team's
runs are counted, not listed; the cohort line pools both queues; the Refresh link re-reads the
queue in place (htmx) after a run is canceled; no console error; the page fits 800 px."""

from __future__ import annotations

import pytest

from apps.core.actor import Actor
from apps.runs import admission, services
from apps.runs.models import Run
from apps.scheduling import services as scheduling_services
from apps.teams.models import Role
from config.celery import app
from tests.apps.runs.test_admission import gpu_node, gpu_run
from tests.browser.test_dashboard import no_sideways_scroll, screenshot
from tests.browser.test_run_charts import login
from tests.factories import ProjectFactory, TeamFactory, make_lab

pytestmark = pytest.mark.slow
WAIT = 15_000
SYSTEM = Actor.system()


@pytest.fixture
def queued(transactional_db, settings, monkeypatch):
    settings.CRUCIBLE = {**settings.CRUCIBLE, "SCHEDULER": True}
    monkeypatch.setattr(app, "send_task", lambda *a, **k: None)  # no worker in this test
    lab = make_lab(Role.MEMBER)
    vision = TeamFactory(slug="vision", name="Vision")
    gpu_node("gpu-1", gpus=2)
    for team in (lab["team"], vision):
        scheduling_services.set_queue(actor=SYSTEM, team_id=team.pk, cohort="research",
                                      nominal={"H100": 1.0}, borrowing_limit={"H100": 0.0})
    mine, theirs = lab["project"], ProjectFactory(team=vision)
    runs = [gpu_run(mine, name="grpo-first"), gpu_run(mine, gpus=2, name="grpo-big"),
            gpu_run(mine, name="grpo-third"), gpu_run(theirs, name="vision-a"),
            gpu_run(theirs, name="vision-b")]
    admission.admission_pass()
    return {r.name: Run.objects.get(pk=r.pk) for r in runs}


def test_queue_page_shows_order_reasons_and_refreshes(asgi_server, browser, queued):
    page, errors = login(browser, asgi_server, "alice")
    page.click("header a:text('Cluster')")
    page.wait_for_url(f"{asgi_server}/cluster/")
    page.click("text=What waits, and why")
    page.wait_for_url(f"{asgi_server}/cluster/queue/")

    lab = page.locator('section[data-queue="lab"]')
    assert lab.locator(".counts").inner_text() == "2 waiting, 1 admitted and starting"
    rows = lab.locator("tbody tr")
    assert rows.count() == 3
    first, big, third = (queued[n] for n in ("grpo-first", "grpo-big", "grpo-third"))
    row = {r.name: lab.locator(f'tr[data-run="{r.pk}"]') for r in (first, big, third)}
    assert row["grpo-first"].locator(".reason").inner_text() == "admitted: starting on gpu-1"
    for run in (big, third):
        assert row[run.name].locator(".reason").inner_text() == run.wait_reason != ""
        assert row[run.name].locator(".position").inner_text() == str(run.queue_position)
    assert row["grpo-big"].locator(".asks").inner_text() == "2 GPUs (any type)"
    assert row["grpo-third"].locator(".asks").inner_text() == "1 GPU (any type)"
    assert "grpo-big" in row["grpo-big"].locator("a").inner_text()

    vision = page.locator('section[data-queue="vision"]')
    assert vision.locator(".counts").inner_text() == "1 waiting, 1 admitted and starting"
    assert vision.locator("tbody tr").count() == 0
    assert "Not your team's runs." in vision.inner_text()
    cohort = page.locator('tr[data-cohort="research"]')
    assert cohort.locator("td").nth(2).inner_text() == "H100 2"
    assert cohort.locator(".in-use").inner_text() == "H100 2"
    assert cohort.locator(".borrowed").inner_text() == "nothing"
    screenshot(page, "queue.png")
    no_sideways_scroll(page)

    # Cancel a waiting run; Refresh swaps the queue in place without a page load.
    services.cancel(actor=SYSTEM, run=third)
    page.evaluate("window.__stay = true")
    page.click("#queue-summary a:text('Refresh')")
    page.wait_for_selector(f'tr[data-run="{third.pk}"]', state="detached", timeout=WAIT)
    assert lab.locator("tbody tr").count() == 2
    assert page.evaluate("window.__stay === true")  # the swap kept the page
    assert lab.locator(".counts").inner_text() == "1 waiting, 1 admitted and starting"
    assert errors == []
