"""The output-filter page in a real browser: an admin goes from the team page to it, sets
the three surfaces, sees them kept and the findings log (kinds, never the text); a viewer
sees the modes but no form; the page fits 800 px; no console error."""

from __future__ import annotations

import pytest

from apps.filtering.models import FilterPolicy, Finding
from apps.teams.models import Membership, Role
from tests.browser.test_dashboard import no_sideways_scroll
from tests.browser.test_run_charts import login
from tests.factories import make_lab

pytestmark = pytest.mark.slow
WAIT = 15_000


@pytest.fixture
def lab(transactional_db):
    lab = make_lab(Role.ADMIN)
    Finding.objects.create(team=lab["team"], surface="samples", action="flag",
                           target_type="sample", target_id="17",
                           kinds=["aws-access-key", "email"])
    return lab


def test_an_admin_sets_the_policy_and_a_viewer_reads_it(asgi_server, browser, lab):
    page, errors = login(browser, asgi_server, "alice")
    page.goto(f"{asgi_server}/t/lab/team/")
    page.click("a:text('Output filtering')")
    page.wait_for_url(f"{asgi_server}/t/lab/filtering/", timeout=WAIT)
    assert page.locator("h1").inner_text().startswith("Output filtering")
    assert page.locator("#findings tbody tr").count() == 1
    assert "aws-access-key, email" in page.locator("#findings").inner_text()
    page.select_option("#mode-samples", "redact")
    page.select_option("#mode-serve", "flag")
    page.select_option("#mode-export", "block")
    page.click("#filter-policy button[type=submit]")
    page.wait_for_selector("text=Output filter saved.", timeout=WAIT)
    policy = FilterPolicy.objects.get(team=lab["team"])
    assert (policy.samples, policy.serve, policy.export) == ("redact", "flag", "block")
    assert page.locator("#mode-samples").input_value() == "redact"
    no_sideways_scroll(page)
    assert errors == []

    Membership.objects.filter(user=lab["user"]).update(role=Role.VIEWER)
    page.reload()
    assert page.locator("#mode-export").inner_text() == "block"
    assert page.locator("#filter-policy button[type=submit]").count() == 0
    assert errors == []
