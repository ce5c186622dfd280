"""The smaller dashboard items in a real browser: a styled 404 with navigation, a favicon,
dark mode following the system, the launch form's default kind and its config reset on a
kind change, "run not found" for a bad base model, and a profile run's report rendered on
its page with the sections that do not apply left out."""

from __future__ import annotations

import json

import httpx
import pytest

from apps.core.storage import store
from apps.runs.models import Run, RunStatus
from apps.teams.models import Role
from tests.browser.test_run_charts import login
from tests.factories import (
    make_lab,
    make_run,
)

pytestmark = pytest.mark.slow
WAIT = 15_000


@pytest.fixture
def lab(transactional_db):
    return make_lab(Role.MEMBER)


def test_404_favicon_dark_mode_launch_defaults_and_reports(asgi_server, browser, lab):
    page, errors = login(browser, asgi_server, "alice")
    # A styled 404 with a way back.
    page.goto(f"{asgi_server}/t/lab/runs/00000000-0000-0000-0000-000000000000/")
    assert page.locator("h1").inner_text() == "Page not found"
    assert page.locator("nav.tabs, .nf-links a").count() >= 1
    page.click(".nf-links a:text('RL Lab')")
    page.wait_for_url(f"{asgi_server}/t/lab/")
    errors.clear()  # the 404 response itself is logged by the browser
    # The favicon is served.
    icon = page.get_attribute('link[rel="icon"]', "href")
    assert httpx.get(f"{asgi_server}{icon}").status_code == 200

    # The launch form starts as a useful train run; changing the kind resets the config.
    page.goto(f"{asgi_server}/t/lab/launch/")
    assert page.input_value("#id_kind") == "train"
    assert '"sft"' in page.input_value("#id_config")
    page.select_option("#id_kind", "profile")
    assert json.loads(page.input_value("#id_config")) == {"progress_every": 1000,
                                                          "top_values": 5}
    assert "profile starter" in page.inner_text("#config-reset-note")
    # A base model naming a run that does not exist says so.
    page.select_option("#id_kind", "train")
    page.fill("#id_base_model", "run:nope@3")
    page.click("button[value=preview]")
    page.wait_for_selector("#launch-errors", timeout=WAIT)
    assert "run 'nope' not found" in page.inner_text(".launch-form")
    assert [e for e in errors if "status of 400" not in e] == []  # the form's own 400
    errors.clear()

    # A profile run's page: its report rendered, sections of training runs left out.
    run = make_run(lab["project"], lab["dataset"], name="profile-gsm")
    uri = store().put_bytes(f"runs/{run.pk}/profile.json", json.dumps(
        {"records": 8, "fields": {"prompt": {"type": "string", "distinct": 8}}}).encode())
    Run.objects.filter(pk=run.pk).update(status=RunStatus.SUCCEEDED, report_uri=uri)
    page.goto(f"{asgi_server}/t/lab/runs/{run.pk}/")
    table = page.locator("#report-table").inner_text()
    assert "fields.prompt.distinct" in table and "records" in table
    for heading in ("#experts-h", "#ckpt-h", "#samples-h"):
        assert page.locator(heading).count() == 0
    assert page.locator("#pins a").inner_text().startswith("gsm v1")  # pinned data links

    # Dark mode follows the system preference.
    page.emulate_media(color_scheme="dark")
    dark = page.evaluate("getComputedStyle(document.body).backgroundColor")
    page.emulate_media(color_scheme="light")
    light = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert dark != light and dark == "rgb(20, 24, 33)"
    assert errors == []
