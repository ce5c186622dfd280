"""The usage page in a real browser: a viewer opens it from the team nav, picks the window
of the hand-computed world (tests/apps/usage/world.py), reads the totals, the per-day and
per-run tables, and the chart's legend for day 2 under the cursor; the page fits 800 px and
logs no console error."""

from __future__ import annotations

import pytest

from apps.teams.models import Role
from tests.apps.usage.world import RATES, build
from tests.browser.test_dashboard import no_sideways_scroll, screenshot
from tests.browser.test_run_charts import login
from tests.factories import make_lab

pytestmark = pytest.mark.slow
WAIT = 15_000


@pytest.fixture
def lab(transactional_db, settings):
    settings.CRUCIBLE = {**settings.CRUCIBLE, "COST_PER_GPU_HOUR": RATES,
                         "COST_CURRENCY": "USD"}
    lab = make_lab(Role.VIEWER)
    lab["runs"] = build(lab["project"], lab["dataset"])
    return lab


def legend(page) -> dict[str, str]:
    rows = page.locator("#usage-chart .u-legend .u-series")
    return {rows.nth(i).locator(".u-label").inner_text(): rows.nth(i).locator(".u-value")
            .inner_text() for i in range(rows.count())}


def test_viewer_reads_a_window_of_usage(asgi_server, browser, lab):
    page, errors = login(browser, asgi_server, "alice")
    page.click("header nav a:text('Usage')")
    page.wait_for_url(f"{asgi_server}/t/lab/usage/")
    assert page.locator("h1").inner_text() == "Usage"
    # the default window (the last 7 days) is empty in this world
    assert page.inner_text("#no-usage").startswith("No run of this team held")

    page.fill("#usage-from", "2026-03-02")
    page.fill("#usage-to", "2026-03-03")
    page.click("button:text('Show')")
    page.wait_for_selector('#usage-chart[data-ready="2"]', timeout=WAIT)
    assert page.url.endswith("/t/lab/usage/?from=2026-03-02&to=2026-03-03")
    assert page.inner_text("#usage-total-h") == "2026-03-02 to 2026-03-04 00:00 UTC"
    assert page.inner_text("#total-allocated") == "102.00"
    assert page.inner_text("#total-useful") == "80.00"
    assert page.inner_text("#total-goodput") == "78.4%"
    assert page.inner_text("#total-lost-preemption") == "16.00"
    assert page.inner_text("#total-lost-failure") == "0.00"
    assert page.inner_text("#total-held") == "1.20"
    assert page.inner_text("#total-cpu") == "208.00"
    assert page.inner_text("#total-cost") == "255.20 USD"
    assert page.inner_text("#by-type") == "By GPU type: H100 102.00"
    day2 = page.locator('#usage-days tr[data-day="2026-03-03"]')
    assert day2.locator(".allocated").inner_text() == "70.00"
    assert day2.locator(".useful").inner_text() == "50.40"
    assert day2.locator(".lost").inner_text() == "16.00"
    assert page.locator('#usage-days tr[data-day="2026-03-02"] .cost').inner_text() == \
        "80.20 USD"  # 32 GPU-h x 2.5 + 4 CPU-only core-hours x 0.05
    gpu_row = page.locator(f'#usage-runs tr[data-run="{lab["runs"]["gpu"].pk}"]')
    assert gpu_row.locator("a").inner_text() == "grpo-preempted"
    assert gpu_row.locator(".restart").inner_text() == "3.20"
    assert gpu_row.locator(".redone").inner_text() == "20"  # reached 70, resumed from 50
    assert gpu_row.locator(".goodput").inner_text() == "78.4%"
    assert page.locator("#usage-runs tbody tr").count() == 2
    cpu_row = page.locator(f'#usage-runs tr[data-run="{lab["runs"]["cpu"].pk}"]')
    assert cpu_row.locator(".cpu").inner_text() == "4.00"
    assert cpu_row.locator(".cost").inner_text() == "0.20 USD"

    # The chart: one bar per day stacked by part; the legend reads each part's own value
    # for the day under the cursor (x spans half a day either side: day 2 is at 3/4).
    over = page.locator("#usage-chart .u-over")
    box = over.bounding_box()
    assert box is not None and box["width"] > 300
    page.mouse.move(box["x"] + 0.75 * box["width"], box["y"] + box["height"] / 2)
    page.wait_for_function("document.querySelector('#usage-chart .u-legend')"
                           ".innerText.includes('50.40')", timeout=WAIT)
    shown = legend(page)
    assert shown["Useful"] == "50.40" and shown["Lost to preemption"] == "16.00"
    assert shown["Restart"] == "3.20" and shown["Held, no attempt running"] == "0.40"
    page.mouse.move(box["x"] + 0.25 * box["width"], box["y"] + box["height"] / 2)
    page.wait_for_function("document.querySelector('#usage-chart .u-legend')"
                           ".innerText.includes('29.60')", timeout=WAIT)
    assert legend(page)["Startup"] == "1.60"
    screenshot(page, "usage.png")
    no_sideways_scroll(page)

    # A window the API refuses is named on the page
    page.fill("#usage-from", "2026-03-05")
    page.click("button:text('Show')")
    page.wait_for_selector("#usage-error", timeout=WAIT)
    assert "must be before" in page.inner_text("#usage-error")
    assert errors == [], "\n".join(errors)
